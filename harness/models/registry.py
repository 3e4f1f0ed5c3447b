"""The model registry: short names for the paper's models, and the rule for everything else.

``phi-1.5`` and the goombalab models resolve to hub ids; any other ``org/name`` hub id, or a local directory
holding a ``config.json``, loads through transformers (or through the Phi-Mamba backend when its config
says so)."""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from harness.registry import Registry


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str  # hub id or local directory
    backend: str  # a name in harness.backends.BACKENDS
    tokenizer: str | None = None  # defaults to ``path``
    description: str = ""


MODELS = Registry("model", {
    "phi-1.5": ModelSpec("phi-1.5", "microsoft/phi-1_5", "transformers",
                         description="Phi-1.5 (1.4B Transformer, 2,048-token context)"),
    "phi-mamba": ModelSpec("phi-mamba", "goombalab/Phi-Mamba", "phi-mamba", tokenizer="microsoft/phi-1_5",
                           description="Phi-Mamba: Phi-1.5 distilled into discrete Mamba-2 mixers (MOHAWK)"),
    "hybrid-phi-mamba": ModelSpec("hybrid-phi-mamba", "goombalab/Hybrid-Phi-Mamba", "phi-mamba",
                                  tokenizer="microsoft/phi-1_5",
                                  description="Hybrid Phi-Mamba: Mamba-2 mixers with a few Phi attention layers"),
})

PHI_TOKENIZER = "microsoft/phi-1_5"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UnknownModelError(ValueError):
    pass


def resolve_model(name: str) -> ModelSpec:
    """Map a registry name, local directory or hub id to a ModelSpec; anything else lists the known names."""
    if name in MODELS:
        return MODELS.get(name)
    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise UnknownModelError(f"model directory {str(path)!r} has no config.json; save it with "
                                    "save_pretrained() or point --model at a checkpoint directory")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise UnknownModelError(f"{cfg_file} is not valid JSON ({e}); the checkpoint is corrupt or was cut "
                                    "short: save it again with save_pretrained()") from None
        if not isinstance(cfg, dict):
            raise UnknownModelError(f"{cfg_file} must hold a JSON object (a model config), got {type(cfg).__name__}")
        backend = backend_for_config(cfg)
        has_tokenizer = any((path / f).is_file() for f in TOKENIZER_FILES)
        # goombalab's checkpoint folders carry no tokenizer: theirs is Phi-1.5's
        tokenizer = None if has_tokenizer or backend != "phi-mamba" else PHI_TOKENIZER
        return ModelSpec(name, str(path), backend, tokenizer=tokenizer)
    if _looks_like_a_path(name):
        parent = path.parent
        near = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir() if p.is_dir()], n=3) \
            if parent.is_dir() else []
        hint = f"; close names in {parent}/: {', '.join(near)}" if near else \
            (f" ({parent}/ exists)" if parent.is_dir() else f" (neither does {parent}/)")
        raise UnknownModelError(f"model directory {name!r} does not exist{hint}. A hub model is named org/name "
                                "with no folder of that name here.")
    if _HUB_ID.match(name):
        return ModelSpec(name, name, "transformers")
    known = "\n".join(f"  {s.name:18s} {s.path:28s} {s.description}" for s in map(MODELS.get, MODELS.names()))
    raise UnknownModelError(f"unknown model {name!r}: not a registered name, an existing directory, or a hub id "
                            f"of the form org/name. Registered models:\n{known}")


def _looks_like_a_path(name: str) -> bool:
    """``./x``, ``/x``, ``~/x``, ``a/b/c``, or ``runs/x`` where ``runs/`` is a folder here: never a hub id."""
    path = Path(name).expanduser()
    return (name.startswith((".", "/", "~")) or len(path.parts) > 2
            or (len(path.parts) == 2 and path.parent.is_dir()))


def backend_for_config(cfg: dict) -> str:
    """goombalab checkpoints carry a ``LanguageModel``/``MixerModel`` config rather than a ``model_type``."""
    if cfg.get("model_type") in ("phi-mamba", "phi_mamba") or "MixerModel" in cfg or "LanguageModel" in cfg:
        return "phi-mamba"
    return "transformers"
