"""transformers backend: any ``AutoModelForCausalLM`` checkpoint (Phi-1.5, Llama, GPT-2, ...)."""
from __future__ import annotations

import copy
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from harness.backends.base import Backend, resolve_device, resolve_dtype
from harness.generation import last_real_index

log = logging.getLogger("harness")


def load_tokenizer(path: str):
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


class TransformersBackend(Backend):
    name = "transformers"

    def __init__(self, path: str, tokenizer: str | None = None, device: str = "auto", dtype: str = "auto",
                 model=None, tok=None):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.path = path
        self.tokenizer = tok if tok is not None else load_tokenizer(tokenizer or path)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)

    # -- stepper ---------------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), {"cache": out.past_key_values, "pos": pos[:, -1]}

    def step(self, state, input_ids, attention_mask):
        block_mask = attention_mask[:, -input_ids.shape[1]:]
        pos = state["pos"][:, None] + block_mask.cumsum(-1)  # pads (right of the real tokens) are masked anyway
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                         past_key_values=state["cache"], use_cache=True)
        last = last_real_index(block_mask)
        state["pos"] = pos.gather(1, last[:, None]).squeeze(1)
        return out.logits[torch.arange(len(last), device=last.device), last].float()

    def expand(self, state, n):
        cache = copy.deepcopy(state["cache"])
        cache.batch_repeat_interleave(n)
        return {"cache": cache, "pos": state["pos"].repeat_interleave(n, dim=0)}

    def select(self, state, keep):
        state["cache"].batch_select_indices(keep)
        state["pos"] = state["pos"].index_select(0, keep)
        return state

    def bytes_per_token(self) -> int:
        cfg = self.model.config
        layers = getattr(cfg, "num_hidden_layers", 1)
        heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 1)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elt = torch.finfo(self.dtype).bits // 8
        # K and V for every layer, plus the hidden state and the logits row of the step that uses them.
        return 2 * layers * heads * head_dim * elt + 8 * cfg.hidden_size * elt

    def describe(self):
        return {"backend": self.name, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "model_class": type(self.model).__name__, "max_context": self.max_context,
                "parameters": sum(p.numel() for p in self.model.parameters())}
