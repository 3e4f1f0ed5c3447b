"""A model name to a loaded backend, in two steps: ``resolve`` decides everything once (the registry's spec for
the name, the backend class, the device, the dtype, CUDA graphs, the engine's arguments) into a
``ResolvedModel``, which the run's settings hash, ``load`` and the audit all read; ``load`` builds the backend
(the hub check names what is missing). One factory for the engine, lm-eval's ``icr`` model, the audit, the
doctor and the GPU suite."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from harness import hub
from harness.backends import BACKENDS, backend_class, graphs_compiled, graphs_used
from harness.backends.base import Backend, resolve_device, resolve_dtype
from harness.backends.fla_models import FlaError
from harness.backends.tokenizer import TokenizerError
from harness.backends.vllm_backend import VLLMError
from harness.models import resolve_model
from harness.models.registry import ModelSpec

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
    if (name != spec.backend and backend_class(spec.backend).own_checkpoints
            and spec.backend not in backend_class(name).runs_checkpoints_of):
        also = [n for n in BACKENDS.names() if spec.backend in backend_class(n).runs_checkpoints_of]
        raise ValueError(f"{model} is a checkpoint of the {spec.backend} backend's own kind, not a transformers "
                         f"model; only --backend {spec.backend} (or auto){''.join(f' or {n}' for n in also)} runs it")
    return name


@dataclass(frozen=True)
class ResolvedModel:
    """A model as the run will load it, decided once: the registry's spec, the backend, the device and dtype as
    given (what the backend is built with) and as they resolve here (what the settings hash records), whether it
    decodes from CUDA graphs, and the engine's arguments (parsed by the backend class)."""

    name: str  # as given (a registered name, a hub id or a folder)
    spec: ModelSpec
    backend: str
    device_arg: str
    dtype_arg: str
    device: torch.device
    dtype: str  # float32, bfloat16 or float16
    graph_decode: bool
    compiled_decode: bool  # the graphed step compiled by inductor first (``--cuda-graphs compiled``)
    engine_args: dict[str, Any]
    tokenizer_given: bool = False

    @property
    def backend_class(self) -> type[Backend]:
        return backend_class(self.backend)

    def identity(self) -> dict[str, Any]:
        """What the settings hash holds for this backend beyond the flags (an engine's version and settings)."""
        return self.backend_class.run_identity(self.spec.path, self.device_arg, self.dtype_arg, self.engine_args)

    def on_device(self, device: str) -> "ResolvedModel":
        """The same model on another device (a rank's GPU)."""
        return resolve(self.name, self.spec.tokenizer if self.tokenizer_given else None, self.backend, device,
                       self.dtype_arg, self.graph_mode, self.engine_args, self.spec)

    @property
    def graph_mode(self) -> str:
        """``--cuda-graphs`` as this model resolved it: compiled, on or off."""
        return "compiled" if self.compiled_decode else "on" if self.graph_decode else "off"

    def reference(self, backend: str | None = None) -> "ResolvedModel":
        """The audit's reference: float32, no CUDA graphs, by ``backend`` where given (no engine arguments)."""
        name = backend or self.backend
        return resolve(self.name, self.spec.tokenizer if self.tokenizer_given else None, name, self.device_arg,
                       "float32", "off", self.engine_args if name == self.backend else {}, self.spec)

    def load(self) -> Backend:
        return _build(self)


def resolve(model: str, tokenizer: str | None = None, backend: str = "auto", device: str = "auto",
            dtype: str = "auto", cuda_graphs: str = "auto", engine_args: Sequence[str] | dict | None = None,
            spec: ModelSpec | None = None) -> ResolvedModel:
    """Every choice about ``model`` that can be made before it loads; an unknown name, a missing folder, a
    backend that cannot run the checkpoint or an engine argument it does not take fails here, at once.
    ``engine_args``: ``--vllm-arg`` pairs (parsed by the backend class) or already parsed ones."""
    spec = spec or model_spec(model, tokenizer)
    name = backend_name(model, spec, backend)
    cls = backend_class(name)
    if cuda_graphs in ("on", "compiled") and not cls.graph_decode_capable:
        graphed = ", ".join(n for n in BACKENDS.names() if backend_class(n).graph_decode_capable)
        raise ValueError(f"--cuda-graphs applies to the backends that decode from CUDA graphs ({graphed}); {model} "
                         f"runs on the {name} backend")
    dev = resolve_device(device)
    args = dict(engine_args) if isinstance(engine_args, dict) else cls.parse_engine_args(engine_args)
    # a checkpoint whose own backend defaults to float32 (Phi-Mamba) runs in float32 on any engine (vLLM's too)
    float32 = cls.float32_default or backend_class(spec.backend).float32_default
    return ResolvedModel(name=model, spec=spec, backend=name, device_arg=device, dtype_arg=dtype, device=dev,
                         dtype=str(resolve_dtype(dtype, dev, float32)).replace("torch.", ""),
                         graph_decode=graphs_used(cuda_graphs, cls, dev),
                         compiled_decode=graphs_compiled(cuda_graphs, cls, dev), engine_args=args,
                         tokenizer_given=bool(tokenizer))


def load_backend(model: str, device: str = "auto", dtype: str = "auto", backend: str = "auto",
                 tokenizer: str | None = None, cuda_graphs: str = "auto", engine_args: dict | None = None) -> Backend:
    """Resolve a model name and build its backend (``backend`` overrides the registry's choice, ``tokenizer`` the
    checkpoint's own or the registry's tokenizer; ``engine_args``: an engine's own settings, ``--vllm-arg``)."""
    return resolve(model, tokenizer, backend, device, dtype, cuda_graphs, engine_args).load()


def _build(m: ResolvedModel) -> Backend:
    spec, model, name, cls = m.spec, m.name, m.backend, m.backend_class
    if not m.tokenizer_given and spec.tokenizer and Path(spec.path).is_dir():
        log.info("%s has no tokenizer of its own; using %s's (--tokenizer chooses another)", spec.path, spec.tokenizer)
    extra: dict[str, Any] = {"graph_decode": True} if m.graph_decode else {}
    if m.compiled_decode:
        extra["compile_decode"] = True
    if m.engine_args:
        extra["engine_args"] = m.engine_args
    hub.require((spec.path, "model"), (spec.tokenizer, "tokenizer"))
    try:
        return cls(spec.path, tokenizer=spec.tokenizer, device=m.device_arg, dtype=m.dtype_arg, **extra)
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
