"""One run, as data: every flag of ``harness.eval`` lands in a RunConfig, which is written into results.json."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# Fields that change what a sample's generation is; a resumed run must agree on all of them.
_RESULT_FIELDS = ("model", "backend", "task", "task_args", "data", "split", "distractors", "shots", "template", "max_new_tokens",
                  "dtype", "seed", "stop", "retrieval", "max_tool_calls", "tool_timeout", "tool_max_chars")


@dataclass
class RunConfig:
    model: str
    backend: str = "auto"
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

    def result_hash(self) -> str:
        """Hash of what determines outputs (not positions, limits, batch size or device), for safe resume."""
        d = self.to_dict()
        key = {k: d[k] for k in _RESULT_FIELDS}
        key["template_sha256"] = self.template_sha256
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
