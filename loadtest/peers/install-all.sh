#!/usr/bin/env bash
# Every peer router the comparative benchmarks use (see README.md here); each script is idempotent.
# About 3 minutes and 1.1 GB on a fresh machine (LiteLLM is most of both).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
for peer in vllm-router sglang-router litellm nginx; do
    "$here/install-$peer.sh"
done
