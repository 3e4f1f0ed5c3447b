"""One run, as data: every flag of ``harness.eval`` lands in a RunConfig, which is written into results.json.

``validate`` checks every flag before anything is written; ``resolved`` turns the settings that decide a
sample's generation into content (absolute paths, the dtype and device type that will really be used, the
data's and the template's hashes), so two spellings of one run are one run and a resumed run can never mix
rows made under different settings."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A flag's value cannot work; the message names the flag and the fix."""


@dataclass
class RunConfig:
    model: str
    backend: str = "auto"
    tokenizer: str | None = None  # default: the checkpoint's own, or the registry's (Phi-1.5's for goombalab's)
    task: str = "hotpotqa"
    task_args: dict = field(default_factory=dict)  # task-specific options, e.g. IsTree's nodes and setup
    data: str | None = None
    split: str = "validation"
    distractors: int = 8
    positions: list[str] = field(default_factory=lambda: ["first", "middle", "last"])
    shots: int = 4
    template: str | None = None
    limit: int | None = None
    ids: str | None = None
    batch_size: str = "auto"
    max_new_tokens: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 1234
    output: str = "runs/latest"
    stop: list[str] | None = None
    retrieval: bool = False
    max_tool_calls: int = 4
    tool_timeout: float = 1.0
    tool_max_chars: int = 300
    prefix_reuse: bool = True  # identical outputs either way, so not part of the resume hash
    template_sha256: str | None = None  # filled in by the engine from the resolved template file

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise ConfigError for the first flag whose value cannot work."""
        def bad(flag, value, need):
            raise ConfigError(f"{flag} {value!r}: {need}")

        if self.batch_size != "auto" and not (str(self.batch_size).isdigit() and int(self.batch_size) > 0):
            bad("--batch-size", self.batch_size, "use a positive integer or 'auto'")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            bad("--max-new-tokens", self.max_new_tokens, "use a positive number of tokens (or leave it out for "
                "the task's default)")
        if self.limit is not None and self.limit < 1:
            bad("--limit", self.limit, "use a positive number of questions (or leave it out for all)")
        if self.shots < 0:
            bad("--shots", self.shots, "use 0 or more exemplars")
        if self.distractors < 0:
            bad("--distractors", self.distractors, "use 0 (oracle: gold paragraphs only) or more")
        if not (isinstance(self.tool_timeout, (int, float)) and math.isfinite(self.tool_timeout)
                and self.tool_timeout > 0):
            bad("--tool-timeout", self.tool_timeout, "use a positive, finite number of seconds, e.g. 1.0")
        if self.max_tool_calls < 1:
            bad("--max-tool-calls", self.max_tool_calls, "use 1 or more (leave out --retrieval for no tool)")
        if self.tool_max_chars < 4:
            bad("--tool-max-chars", self.tool_max_chars, "use 4 or more characters")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            bad("--stop", self.stop, "stop strings must be non-empty")
        self.resolved_device()

    def resolved_device(self):
        import torch

        from harness.backends.base import resolve_device

        try:
            dev = resolve_device(self.device)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"--device {self.device!r} is not a device torch knows ({e}); use auto, cpu, cuda, "
                              "cuda:N or mps") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device!r}: no CUDA GPU is visible to torch "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use "
                              "--device cpu or auto, or a CUDA build of torch on a GPU machine")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {self.device!r}: only {torch.cuda.device_count()} GPU(s) are visible")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ConfigError(f"--device {self.device!r}: MPS is not available here; use --device cpu or auto")
        return dev

    def resolved(self, data_sha256: str, template_sha256: str, model_path: str | None = None) -> dict[str, Any]:
        """What determines a sample's generation, as content: the key of the resume hash. Positions, limits,
        ids, batch size and prefix reuse are left out: they choose which rows exist, not what a row holds."""
        from harness.backends.base import resolve_dtype
        from harness.models import UnknownModelError, resolve_model

        dev = self.resolved_device()
        try:
            family = self.backend if self.backend != "auto" else resolve_model(self.model).backend
        except UnknownModelError:
            family = None  # reported when the model is loaded
        try:
            dtype = str(resolve_dtype(self.dtype, dev, family)).replace("torch.", "")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        model = model_path or self.model
        local = Path(model).expanduser()
        tok = Path(self.tokenizer).expanduser() if self.tokenizer else None
        return {"model": str(local.resolve()) if local.is_dir() else model, "backend": self.backend,
                "tokenizer": str(tok.resolve()) if tok is not None and tok.is_dir() else self.tokenizer,
                "task": self.task, "task_args": self.task_args, "data_sha256": data_sha256,
                "split": self.split, "distractors": self.distractors, "shots": self.shots,
                "template_sha256": template_sha256, "max_new_tokens": self.max_new_tokens, "dtype": dtype,
                "device_type": dev.type, "seed": self.seed, "stop": self.stop, "retrieval": self.retrieval,
                "max_tool_calls": self.max_tool_calls, "tool_timeout": float(self.tool_timeout),
                "tool_max_chars": self.tool_max_chars}


def settings_hash(resolved: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]


def content_sha256(rows: list) -> str:
    """Hash of the loaded data (not its path): an edited data file is a different run, a moved one is not."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()[:16]
