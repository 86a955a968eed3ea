#!/usr/bin/env bash
# vLLM's Rust router (PyPI `vllm-router`: a PyO3 wheel and its `vllm-router` console script) into
# .venv-peers/vllm-router. Idempotent.
source "$(dirname "$0")/_lib.sh"
install_pip_peer vllm-router vllm-router "$VLLM_ROUTER_VERSION"
