"""Where the GPU kernels come from, decided in one place so every caller (Phi-Mamba, the doctor) agrees.

mamba-ssm's Triton kernels, the chunked SSD scan (``mamba_chunk_scan_combined``) for prompts and
``selective_state_update`` for decoding, are used when mamba-ssm imports and the tensors are on a CUDA GPU,
or when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``), which is how CI tests this glue without a
GPU. ``enable_cpu_interpreter`` applies what the interpreter needs from a mamba-ssm source tree (pip cannot
build mamba-ssm without CUDA): the sources on ``sys.path``, empty stand-ins for its CUDA extension modules,
a no-op ``torch.cuda.device`` and autotuning reduced to each kernel's first config (benchmarking needs a GPU)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import torch

from harness.ops.interpreter import speed_up

MAMBA_SSM_VERSION = "2.3.2.post1"  # the sdist the CPU-interpreter tests and the doctor fetch
CALLS: dict[str, int] = {"chunk_scan": 0, "state_update": 0}  # kernel launches, so a test can see the path ran
INT32_MAX = 2**31 - 1  # the most elements one kernel call may span (``int32_safe_rows``)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable_on(t: torch.Tensor | torch.device) -> bool:
    """Whether the kernels can run on this tensor's device (or this device: decided without touching it)."""
    return (t if isinstance(t, torch.device) else t.device).type == "cuda" or interpreting()


_LOADED: dict[str, types.SimpleNamespace | None] = {}  # ``mamba_ssm_ops``'s answer, once a process


def mamba_ssm_ops() -> types.SimpleNamespace | None:
    """mamba-ssm's Triton ops if they import and can run here (a GPU or the interpreter); else None. Remembered
    in a plain dict, not ``functools.lru_cache``: a compiled decode step traces this call, and dynamo cannot
    trust an lru_cache's wrapper."""
    if "ops" not in _LOADED:
        _LOADED["ops"] = _load_mamba_ssm_ops()
    return _LOADED["ops"]


def _load_mamba_ssm_ops() -> types.SimpleNamespace | None:
    if not (torch.cuda.is_available() or interpreting()):
        return None
    # float32 means IEEE float32: Triton's tl.dot otherwise rounds float32 inputs to TF32 on NVIDIA GPUs, which
    # moved the scan's logits by 4e-2 against the reference on an H100 (cuBLAS float32 stays IEEE: PyTorch's
    # default). Read when a kernel compiles; a value the user set (TRITON_F32_DEFAULT) wins.
    from triton import knobs  # lazy: triton is an optional install

    if os.environ.get("TRITON_F32_DEFAULT") is None:
        knobs.language.fp32_default = "ieee"
    try:
        with carried_sources():
            from mamba_ssm.ops.triton.selective_state_update import (
                selective_state_update,
            )
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or built for another torch
        return None
    return types.SimpleNamespace(chunk_scan=mamba_chunk_scan_combined, state_update=selective_state_update)


def int32_safe_rows(batch: int, per_row_elements: int) -> list[slice]:
    """Row groups small enough for mamba-ssm's Triton kernels, which form a row's offset in 32-bit arithmetic:
    past 2**31 elements in one call they read or write the wrong memory, silently or as an illegal address
    (state-spaces/mamba#1015; seen here on an H100 at batch 2x the auto batch). Rows are independent in these
    kernels, so splitting changes no row's result."""
    step = max(1, INT32_MAX // max(1, per_row_elements))
    return [slice(i, min(i + step, batch)) for i in range(0, batch, step)]


def float32_dots() -> str:
    """How the kernels' float32 dot products round, once ``mamba_ssm_ops`` has loaded them: ``ieee`` (set there)
    or what ``TRITON_F32_DEFAULT`` says."""
    from triton import knobs  # lazy: triton is an optional install

    return knobs.language.fp32_default or "tf32"


def require(scan: str, t: torch.Tensor | torch.device) -> types.SimpleNamespace | None:
    """The ops for ``scan`` = "auto" (kernels when usable), "kernel" (kernels or an error) or "torch" (never)."""
    if scan == "torch":
        return None
    ops = mamba_ssm_ops()
    if ops is not None and usable_on(t):
        return ops
    if scan == "kernel":
        raise RuntimeError("mamba-ssm kernels were asked for but cannot run here: "
                           f"{'not importable' if ops is None else 'tensors are not on a CUDA device'} "
                           "(install mamba-ssm on a GPU machine, or use the reference scan)")
    return None


def status() -> dict:
    """What is installed and which path the Phi-Mamba scan will take (for the doctor and the logs)."""
    out = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "cuda_build": torch.version.cuda, "triton_interpret": interpreting()}
    for pkg in ("triton", "mamba_ssm", "causal_conv1d", "vllm"):
        out[pkg] = importlib.util.find_spec(pkg) is not None
    out["phi_mamba_scan"] = "mamba-ssm triton" if mamba_ssm_ops() is not None else "pytorch reference"
    return out


STAND_INS = ("selective_scan_cuda", "causal_conv1d_cuda", "causal_conv1d")  # CUDA extensions it imports on load


@contextlib.contextmanager
def carried_sources():
    """A mamba-ssm source tree carried to a machine where pip cannot build it (the GPU machines: no network, no
    compiler for its CUDA extensions): ``ICR_MAMBA_SSM_SRC`` names it, and its Triton ops import with empty
    stand-ins for the CUDA extension modules it imports at top level (the ops used here need none of them).
    Afterwards the tree, the stand-ins and the ``mamba_ssm`` modules leave ``sys.path`` and ``sys.modules``
    again, so transformers does not find a mamba-ssm whose CUDA extensions are empty stand-ins and call them
    (its Falcon-Mamba did, on an H100); the two ops keep their modules alive."""
    src = os.environ.get("ICR_MAMBA_SSM_SRC")
    path = str(Path(src).resolve()) if src else None
    if path is None or path in sys.path or "mamba_ssm" in sys.modules:
        yield
        return
    added = [n for n in STAND_INS if n not in sys.modules]
    sys.path.insert(0, path)
    sys.modules.update({n: types.ModuleType(n) for n in added})
    try:
        yield
    finally:
        sys.path.remove(path)
        for name in [*added, *(m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm."))]:
            sys.modules.pop(name, None)


def interpreter_env(mamba_ssm_src: str | Path) -> dict:
    """The environment of a child process that runs mamba-ssm's Triton kernels on CPU tensors under Triton's
    interpreter (the interpreter is chosen when triton is imported, so only a new process can switch it on):
    the source tree is imported as a carried tree is."""
    return {**os.environ, "TRITON_INTERPRET": "1", "ICR_MAMBA_SSM_SRC": str(Path(mamba_ssm_src).resolve())}


def enable_cpu_interpreter() -> None:
    """In a process started with ``interpreter_env``: make mamba-ssm's Triton kernels runnable on CPU tensors."""
    if not (interpreting() and os.environ.get("ICR_MAMBA_SSM_SRC")):
        raise RuntimeError("start this process with harness.ops.kernels.interpreter_env(SOURCE_TREE)")
    triton_on_cpu()
    _LOADED.clear()


def triton_on_cpu() -> None:
    """What Triton kernels (mamba-ssm's, fla's) need to run on CPU tensors once ``TRITON_INTERPRET=1`` was set
    before triton was imported: autotuning reduced to each kernel's first config (timing configs needs a GPU;
    every config computes the same result), a no-op ``torch.cuda.device`` (kernels enter the tensor's device) and
    the interpreter without the work it repeats (``harness.ops.interpreter``).
    Idempotent; changes this process only."""
    if not interpreting():
        raise RuntimeError("Triton kernels on CPU need TRITON_INTERPRET=1 in the environment before the program "
                           "starts (it must be set before triton is imported)")
    from triton.runtime import autotuner

    speed_up()
    if getattr(autotuner.Autotuner.run, "_first_config_only", False):
        return
    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    first_config._first_config_only = True
    autotuner.Autotuner.run = first_config
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()


def fetch_mamba_ssm_sources(cache_dir: str | Path) -> Path:
    """The mamba-ssm source tree from its sdist on the package index, cached under ``cache_dir``; fetched under a
    file lock, so processes that ask at once (parallel test workers, two doctors) fetch it once and never read a
    half-extracted tree."""
    from filelock import FileLock

    root = Path(cache_dir) / f"mamba_ssm-{MAMBA_SSM_VERSION}"
    marker = root / "mamba_ssm" / "ops" / "triton" / "ssd_combined.py"
    if marker.is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"), tempfile.TemporaryDirectory() as tmp:
        if marker.is_file():  # another process fetched it while this one waited
            return root
        env = dict(os.environ, MAMBA_SKIP_CUDA_BUILD="TRUE")
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              "--no-build-isolation", "-q", "-d", tmp, f"mamba-ssm=={MAMBA_SSM_VERSION}"],
                             capture_output=True, text=True, timeout=600, env=env)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if res.returncode != 0 or not sdists:
            raise OSError(f"could not fetch mamba-ssm=={MAMBA_SSM_VERSION} from the package index: "
                          f"{res.stderr.strip()[-300:]}")
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if "/mamba_ssm/" in m.name and m.isfile()]
            tar.extractall(root.parent, members=members, filter="data")
    return root
