"""Phi-Mamba / Hybrid-Phi-Mamba backend: the project's own model (harness.models.phi_mamba) in the shared loop."""
from __future__ import annotations

import logging

import torch

from harness.backends.base import (
    BackendInfo,
    JoinsBatches,
    MergesRows,
    ScoresBlocks,
    ScoresText,
    resolve_device,
    resolve_dtype,
)
from harness.backends import cpu_heap, onednn_linear
from harness.backends.generation import logits_at_last_real
from harness.backends.step import StepBackend
from harness.backends.tokenizer import load_tokenizer
from harness.ops import kernels
from harness.models.decode_graphs import GraphedDecode
from harness.models.phi_mamba import PhiMambaForCausalLM, PhiMambaState

log = logging.getLogger("harness")


def scan_path(scan: str, device: torch.device) -> str:
    """The scan a model asking for ``scan`` (auto, kernel, torch) runs on ``device``, as results and the settings
    hash name it: the same answer before the model loads (the CLI's hash) and after (a backend passed in). Asked
    of the device, not a tensor on it: before loading, no CUDA context is made (a rank's would land on GPU 0)."""
    if kernels.require(scan, device):
        return f"mamba-ssm triton kernels, float32 dots {kernels.float32_dots()}"
    return "pytorch reference"


class PhiMambaBackend(StepBackend, MergesRows, JoinsBatches, ScoresText, ScoresBlocks):
    name = "phi-mamba"
    # the paper's Phi-Mamba numbers (and the official evaluation) ran in float32; bf16 moved logits by up to
    # 2e-2 and flipped 0-2% of argmaxes on CPU
    float32_default = True
    graph_decode_capable = True
    own_checkpoints = True  # goombalab's modules, not a transformers model type

    def __init__(self, path: str, tokenizer: str | None = None, device: str = "auto", dtype: str = "auto",
                 model: PhiMambaForCausalLM | None = None, tok=None, graph_decode: bool = False,
                 compile_decode: bool = False):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, self.float32_default)
        self.tokenizer = tok if tok is not None else load_tokenizer(tokenizer or path)
        self.model = (model or PhiMambaForCausalLM.from_pretrained(path, dtype=self.dtype)).to(self.device, self.dtype)
        self.model.eval()
        self.linear = onednn_linear.identity(self.device, self.dtype).get("linear")
        changes = (onednn_linear.use_onednn(self.model, self.device, self.dtype),
                   cpu_heap.keep_freed_memory(self.device))
        self.fused = [c for c in changes if c]
        cfg = self.model.config
        # Attention layers are Phi's (2,048 positions); a pure Mamba stack has no position limit.
        self.max_context = cfg.max_position_embeddings if cfg.attn_layers else None
        self.scan = scan_path(self.model.scan, self.device)
        self.graphs = None
        if graph_decode:
            if self.device.type != "cuda":
                raise ValueError(f"--cuda-graphs needs a CUDA device (this run is on {self.device})")
            self.graphs = GraphedDecode(self.model, compile=compile_decode)
        decode = ("CUDA graphs, compiled" if compile_decode else "CUDA graphs") if self.graphs else "eager"
        log.info("phi-mamba: %d layers (%s attention), scan path: %s, decode: %s", cfg.n_layer,
                 cfg.attn_layers or "no", self.scan, decode)
        if folded := self.fold_gelu():
            self.fused.append(folded)

    @classmethod
    def run_identity(cls, path: str, device: str, dtype: str, options: dict) -> dict:
        """The scan path, hashed before loading: the reference scan and mamba-ssm's kernels round apart, so rows
        from both never mix in one run. A loaded model's default asks for ``auto``."""
        return {**super().run_identity(path, device, dtype, options), "scan": scan_path("auto", resolve_device(device))}

    def prefill(self, input_ids, attention_mask):
        logits, state = self.model(input_ids, attention_mask, logits_to_keep=1)
        return logits[:, -1], state

    def step(self, state, input_ids, attention_mask):
        if self.graphs is not None:
            logits = self.graphs(state, input_ids, attention_mask)
            if logits is not None:
                return logits
        logits, state = self.model(input_ids, attention_mask, state)
        return logits_at_last_real(logits, attention_mask[:, -input_ids.shape[1]:])

    def extend(self, state, ids, past):
        t = torch.tensor([list(ids)], device=self.device)
        logits, _ = self.model(t, torch.ones((1, past + len(ids)), dtype=torch.long, device=self.device), state,
                               logits_to_keep=1)  # eager: a graph-resident state could not be kept as a snapshot
        return logits[:, -1]

    def block_logits(self, state, input_ids, attention_mask):
        return self.model(input_ids, attention_mask, state)[0].float()

    def sequence_logits(self, input_ids):
        return self.model(input_ids)[0]

    def select(self, state, keep):
        return state.select(keep)

    def expand(self, state, n):
        return state.repeat(n)

    def merge(self, states, lengths, shared=0):
        if shared:
            raise ValueError("phi-mamba merges rows left-padded only (merges_shared_front is False)")
        return PhiMambaState.merge(list(states), list(lengths))

    def join_unsupported(self) -> str | None:
        return "the decode graphs keep the batch in fixed buffers" if self.graphs is not None else None

    def key_share(self) -> float:
        cfg = self.model.config
        return len(cfg.attn_layers) / cfg.n_layer

    def join(self, states, cuts):
        return PhiMambaState.join(list(states), list(cuts))

    def bytes_per_token(self) -> int:
        cfg = self.model.config
        elt = torch.finfo(self.dtype).bits // 8
        kv = 2 * len(cfg.attn_layers) * cfg.d_model * elt
        return kv + 8 * cfg.d_model * elt + (cfg.padded_vocab * 4) // 64

    def describe(self) -> BackendInfo:
        return BackendInfo(backend=self.name, device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                           model_class=type(self.model).__name__, max_context=self.max_context, scan=self.scan,
                           decode=self.graphs.describe() if self.graphs is not None else None,
                           parameters=sum(p.numel() for p in self.model.parameters()),
                           fused=self.fused or None, linear=self.linear,
                           extra={"attn_layers": self.model.config.attn_layers})
