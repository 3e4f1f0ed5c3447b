"""A ``StepModel`` as a ``Backend``: generation is the planner's (batching, prefix reuse, the prefix tree), text
scoring the scorer's, memory the probes'. A backend the harness steps itself subclasses ``StepBackend`` and
implements the step contract (``harness.backends.base.StepModel``), naming its optional abilities in its class
line."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from harness.backends import fused_activations, kept_positions, memory, onednn_linear, planner, scoring
from harness.backends.base import (Backend, Generation, GenRequest, ScoresText, StepModel, probe_ids,
                                   resolve_device, resolve_dtype)
from harness.ops import cpu_flash


class StepBackend(Backend, StepModel):
    """The request level over the step level; nothing here decides anything of its own."""

    flash_attention = False  # whether the model's attention may take the CPU flash kernel (``harness.ops.cpu_flash``)
    keeps_positions = False  # whether a CPU prefill may compute its last layer for the kept positions only

    @classmethod
    def run_identity(cls, path: str, device: str, dtype: str, options: dict) -> dict[str, Any]:
        """The CPU's linear and attention kernels where they are not PyTorch's own (``onednn_linear``,
        ``cpu_flash``), and a prefill's last layer computed for its kept positions (``kept_positions``): each
        rounds apart."""
        target = resolve_device(device)
        dt = resolve_dtype(dtype, target, cls.float32_default)
        return {**onednn_linear.identity(target, dt), **(cpu_flash.identity(target, dt) if cls.flash_attention else {}),
                **(kept_positions.identity(target) if cls.keeps_positions else {})}

    @torch.inference_mode()
    def fold_gelu(self) -> str | None:
        """Tanh GELUs folded into the epilogue of the oneDNN linear layers they follow
        (``fused_activations.gelu_into_linear``), checked on a prefill of this backend long enough to take oneDNN;
        what changed, for the run's record (None: nothing)."""
        rows = [m.min_rows for m in self.model.modules() if type(m) is onednn_linear.OneDNNLinear]
        if not rows:
            return None
        ids = probe_ids(self, 1, max(16, min(rows)))
        return fused_activations.gelu_into_linear(self.model, lambda: self.prefill(ids, torch.ones_like(ids))[0])

    def generate_all(self, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                     prefix_reuse: str = "auto", prefix_memory: str | int = "auto", batching: str = "auto"
                     ) -> Generation:
        return planner.generate_all(self, requests, batch_size, prefix_reuse, prefix_memory, batching)

    def loglikelihood(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
                      share_contexts: bool = True) -> list[tuple[float, bool]]:
        if not isinstance(self, ScoresText):
            return super().loglikelihood(pairs, batch_size, share_contexts)
        return scoring.loglikelihood(self, pairs, batch_size, share_contexts)

    def state_bytes(self, tokens: int) -> int | None:
        return memory.state_bytes(self, tokens)

    def token_budget(self) -> int:
        return memory.token_budget(self)

    def prefill_bytes_per_token(self) -> int:
        return memory.prefill_bytes_per_token(self)
