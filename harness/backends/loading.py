"""A model name to a loaded backend: the registry resolves the name (a registered model, a hub id or a local
checkpoint), the hub check names what is missing, and the backend registry builds it. One factory for the
engine, lm-eval's ``icr`` model, the audit, the doctor and the GPU suite."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from harness import hub
from harness.backends import BACKENDS, backend_class, graphs_used
from harness.backends.base import resolve_device
from harness.backends.fla_models import FlaError
from harness.backends.tokenizer import TokenizerError
from harness.backends.vllm_backend import VLLMError
from harness.models import resolve_model

log = logging.getLogger("harness")


class ModelLoadError(ValueError):
    """A model's files exist but cannot be loaded; the message names the directory and its files."""


def model_spec(model: str, tokenizer: str | None = None):
    """The registry's spec for a model name, with ``tokenizer`` (a hub id or local folder) overriding the
    checkpoint's own or the registry's tokenizer."""
    spec = resolve_model(model)
    if tokenizer:
        return dataclasses.replace(spec, tokenizer=str(Path(tokenizer).expanduser().resolve())
                                   if Path(tokenizer).expanduser().is_dir() else tokenizer)
    return spec


def backend_name(model: str, spec, backend: str = "auto") -> str:
    """The backend that runs ``spec``: the registry's choice, or ``backend`` where it can run the checkpoint."""
    name = spec.backend if backend == "auto" else backend
    if name != spec.backend and backend_class(spec.backend).own_checkpoints:
        raise ValueError(f"{model} is a checkpoint of the {spec.backend} backend's own kind, not a transformers "
                         f"model; only --backend {spec.backend} (or auto) runs it")
    return name


def load_backend(model: str, device: str = "auto", dtype: str = "auto", backend: str = "auto",
                 tokenizer: str | None = None, cuda_graphs: str | bool = "auto", engine_args: dict | None = None,
                 spec=None):
    """Resolve a model name through the registry and build its backend (``backend`` overrides the default,
    ``tokenizer`` the checkpoint's own or the registry's tokenizer; ``engine_args``: an engine's own settings,
    ``--vllm-arg``; ``spec``: ``model_spec``'s answer for these, where the caller has it already)."""
    spec = spec or model_spec(model, tokenizer)
    if not tokenizer and spec.tokenizer and Path(spec.path).is_dir():
        log.info("%s has no tokenizer of its own; using %s's (--tokenizer chooses another)", spec.path, spec.tokenizer)
    name = backend_name(model, spec, backend)
    cls = backend_class(name)
    if cuda_graphs in ("on", True) and not cls.cuda_graphs:
        graphed = ", ".join(n for n in BACKENDS.names() if backend_class(n).cuda_graphs)
        raise ValueError(f"--cuda-graphs applies to the backends that decode from CUDA graphs ({graphed}); {model} "
                         f"runs on the {name} backend")
    extra = {"cuda_graphs": True} if graphs_used(cuda_graphs, cls, resolve_device(device)) else {}
    if engine_args:
        extra["engine_args"] = engine_args
    hub.require((spec.path, "model"), (spec.tokenizer, "tokenizer"))
    try:
        return cls(spec.path, tokenizer=spec.tokenizer, device=device, dtype=dtype, **extra)
    except OSError as e:
        tok = spec.tokenizer or spec.path
        hint = (f"\n{spec.path} carries no tokenizer of its own (goombalab's folders do not); its tokenizer is "
                f"{tok}'s. Pass --tokenizer with a local copy of it (a folder holding tokenizer.json), or fill the "
                "HF cache with it.") if Path(spec.path).is_dir() and spec.tokenizer else ""
        raise ModelLoadError(f"could not load model {model!r} (weights {spec.path}, tokenizer {tok}) through the "
                             f"{name} backend: {e}{hint}\nWhere the hub is unreachable, download once with "
                             f"`hf download {spec.path}` elsewhere and copy the HF cache (then HF_HUB_OFFLINE=1 "
                             "skips the network), or pass a local checkpoint directory to --model.") from e
    except (ImportError, TokenizerError, FlaError, VLLMError):
        raise
    except Exception as e:  # a corrupt config, truncated weights, a tokenizer that does not parse, ...
        files = ", ".join(sorted(p.name for p in Path(spec.path).glob("*") if p.is_file())[:12]) \
            if Path(spec.path).is_dir() else spec.path
        raise ModelLoadError(f"could not load model {model!r} from {spec.path} ({files}) through the {name} backend: "
                             f"{type(e).__name__}: {e}\nCheck that the checkpoint files are complete (re-save or "
                             "re-download them); --verbose shows the full traceback.") from e
