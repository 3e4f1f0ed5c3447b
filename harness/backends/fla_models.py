"""Checkpoints of flash-linear-attention (``fla``: GLA, RetNet, DeltaNet, Gated DeltaNet, RWKV-7, HGRN2, ...).

fla registers its model types with transformers' Auto classes when it is imported, so the transformers backend
runs them once ``fla`` is imported: this module imports it when a checkpoint's model type is one transformers does
not know, and says how to install it when it is missing. fla's kernels are Triton only; on CPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``, slow: for tests and tiny models)."""
from __future__ import annotations

import json
from pathlib import Path

from harness.ops import kernels

INSTALL = 'pip install "icr-harness[fla]"'


class FlaError(ValueError):
    """An fla checkpoint that cannot run here (fla missing, or CPU without Triton's interpreter); the message
    says what to do."""


def model_type(path: str, load_kwargs: dict) -> str | None:
    """The checkpoint's ``model_type`` from its config.json (a local folder, or the hub / HF cache)."""
    local = Path(path) / "config.json"
    if not local.is_file():
        try:
            from huggingface_hub import hf_hub_download

            local = Path(hf_hub_download(path, "config.json", **{k: v for k, v in load_kwargs.items()
                                                                  if k in ("revision", "local_files_only")}))
        except Exception:  # not on the hub or not cached: transformers' own error will say so
            return None
    try:
        return json.loads(local.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def is_registered(mtype: str) -> bool:
    from transformers import CONFIG_MAPPING

    return mtype in CONFIG_MAPPING


def register_for(path: str, load_kwargs: dict) -> bool:
    """Import fla if the checkpoint's model type is unknown to transformers and fla can supply it; True when the
    checkpoint is then an fla model. A model type neither knows is left to transformers' own error."""
    mtype = model_type(path, load_kwargs)
    if not mtype or is_registered(mtype):
        return bool(mtype) and is_fla_type(mtype)
    try:
        import fla  # noqa: F401  registers fla's configs and models with the Auto classes
    except ImportError as e:
        raise FlaError(f"{path} is a {mtype!r} checkpoint, a model type transformers does not ship; if it is a "
                       f"flash-linear-attention model, install it: {INSTALL}") from e
    return is_registered(mtype) and is_fla_type(mtype)


def is_fla_type(mtype: str) -> bool:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[mtype] if mtype in CONFIG_MAPPING else None
    return cls is not None and cls.__module__.startswith("fla.")


def prepare_device(device) -> None:
    """fla's kernels on CPU: Triton's interpreter, which must have been switched on before the program started."""
    if device.type != "cpu":
        return

    if not kernels.interpreting():
        raise FlaError("fla models run Triton kernels, which need a GPU; on CPU start the program with "
                       "TRITON_INTERPRET=1 (Triton's interpreter: exact, slow, for tiny models and tests)")
    kernels.triton_on_cpu()
