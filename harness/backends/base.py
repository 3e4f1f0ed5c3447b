"""The backend interface, and the device/dtype choices every backend makes the same way."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from harness.generation import GenRequest, GenResult, Prefix, greedy_generate

log = logging.getLogger("harness")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(device)


# Families whose ``--dtype auto`` is float32 everywhere: the paper's Phi-Mamba numbers (and the official
# Phi-Mamba evaluation) were run in float32; bf16 moved logits by up to 2e-2 and flipped 0-2% of argmaxes on CPU.
FLOAT32_FAMILIES = ("phi-mamba",)


def resolve_dtype(dtype: str, device: torch.device, family: str | None = None) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU that supports it, else float32 (CPU half precision is slow and lossy);
    always float32 for the families in FLOAT32_FAMILIES."""
    if dtype == "auto":
        if device.type == "cuda" and family not in FLOAT32_FAMILIES:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Backend(ABC):
    """Greedy generation over batches of prompts. Subclasses provide the stepper methods."""

    name = "base"
    tokenizer: Any
    device: torch.device
    max_context: int | None = None

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    @abstractmethod
    def step(self, state: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def select(self, state: Any, keep: torch.Tensor) -> Any: ...

    @abstractmethod
    def expand(self, state: Any, n: int) -> Any: ...

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def generate(self, requests: Sequence[GenRequest], shared_prefix: Sequence[int] | None = None) -> list[GenResult]:
        """``shared_prefix``: token ids every prompt starts with (the few-shot exemplars). Its state is
        computed on the first call and copied into each later batch instead of being recomputed."""
        if not hasattr(self, "stats"):
            self.stats: dict[str, int] = {}
        use_prefix = shared_prefix and self.prefix_reuse_pays()
        prefix = self._prefix_state(list(shared_prefix)) if use_prefix else None
        return greedy_generate(self, self.tokenizer, requests, device=self.device, max_context=self.max_context,
                               prefix=prefix, stats=self.stats)

    def prefix_reuse_pays(self) -> bool:
        """Whether feeding each row's suffix as one block after a copied prefix beats a full prefill."""
        return True

    @torch.inference_mode()
    def _prefix_state(self, ids: list[int]) -> Prefix:
        cached = getattr(self, "_prefix", None)
        if cached is None or cached.ids != ids:
            t = torch.tensor([ids], device=self.device)
            logits, state = self.prefill(t, torch.ones_like(t))
            self._prefix = cached = Prefix(ids, state, logits)
            self.stats["prefix_tokens"] = self.stats.get("prefix_tokens", 0) + len(ids)
        return cached

    def token_budget(self) -> int:
        """Tokens (batch x sequence length) one batch may hold; used by ``--batch-size auto``."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(2048, int(free * 0.4 / max(1, self.bytes_per_token())))
        return 16384

    def bytes_per_token(self) -> int:
        """Memory one cached token costs while decoding; a conservative default."""
        return 1 << 20

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "device": str(self.device)}
