#!/usr/bin/env bash
# SGLang's Rust router (PyPI `sglang-router`, the "smg" gateway; run as `python -m sglang_router.launch_router`)
# into .venv-peers/sglang-router. Idempotent.
source "$(dirname "$0")/_lib.sh"
install_pip_peer sglang-router sglang-router "$SGLANG_ROUTER_VERSION"
