#!/usr/bin/env bash
# LiteLLM's proxy (PyPI `litellm[proxy]`, the `litellm` console script) into .venv-peers/litellm. Idempotent.
#
# The pin: never 1.82.7, 1.82.8 or 1.107.0 (compromised releases, pulled from PyPI as malicious). 1.108.7 is
# the newest release whose `[proxy]` extra resolves from PyPI: later ones pin companion packages that were
# never published there (1.108.8: litellm-enterprise==0.1.79.post2; 1.108.13: litellm-proxy-extras==
# 0.4.110.post1; 1.109.3: litellm-proxy-extras==0.4.113; 1.110.x: litellm-proxy).
source "$(dirname "$0")/_lib.sh"
install_pip_peer litellm litellm "$LITELLM_VERSION" "[proxy]"
