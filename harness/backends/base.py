"""The backend interface, and the device/dtype choices every backend makes the same way."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from harness.backends.generation import GenRequest, GenResult, Prefix, greedy_generate

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


def state_nbytes(state: Any) -> int:
    """Bytes of a decoding state: what its ``nbytes()`` says (Phi-Mamba: the filled part of its KV buffers),
    else every distinct tensor reachable from it (a transformers cache's keys, values, conv and SSM states)."""
    if hasattr(state, "nbytes") and callable(state.nbytes):
        return state.nbytes()
    seen, total, todo = set(), 0, [state]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return total


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

    @torch.inference_mode()
    def state_bytes(self, tokens: int) -> int | None:
        """Bytes of decoding state one sequence of ``tokens`` tokens holds (KV cache at its length, conv and SSM
        state, both for hybrids): fitted once from two real prefills as a constant plus a per-token part (exact
        for both kinds of state). None where the backend keeps no state of its own (vLLM)."""
        fit = getattr(self, "_state_fit", False)
        if fit is False:
            try:
                sizes = []
                for n in (8, 24):
                    ids = (torch.arange(n, device=self.device) % max(2, len(self.tokenizer) - 1) + 1)[None]
                    sizes.append(state_nbytes(self.prefill(ids, torch.ones_like(ids))[1]))
                per_token = (sizes[1] - sizes[0]) / 16
                fit = (sizes[0] - 8 * per_token, per_token)
            except NotImplementedError:
                fit = None
            self._state_fit = fit
        return None if fit is None else int(round(fit[0] + fit[1] * tokens))

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
