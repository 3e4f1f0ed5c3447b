"""transformers backend: any ``AutoModelForCausalLM`` checkpoint (Phi-1.5, Llama, GPT-2, ...)."""
from __future__ import annotations

import copy
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import harness.istree_models  # noqa: F401  registers the trainer's model types (icr_hybrid) with the Auto classes
from harness.backends.base import Backend, resolve_device, resolve_dtype
from harness.generation import last_real_index, logits_at_last_real

log = logging.getLogger("harness")


def load_tokenizer(path: str):
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


RECURRENT_TYPES = ("mamba", "icr_hybrid")  # models whose cache is a recurrent state (cache_params=)


class TransformersBackend(Backend):
    """Attention models step with a DynamicCache; Mamba-style models (``RECURRENT_TYPES``) with
    ``cache_params``. transformers' Mamba masks padded positions before and after its convolution, so a
    left-padded prefill is exact; it cannot continue a cached sequence by more than one token per call, so a
    multi-token block (a tool result) is fed token by token, restoring the state of rows whose block has
    already ended (padding)."""

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
        self.recurrent = self.model.config.model_type in RECURRENT_TYPES
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        if self.model.config.model_type == "mamba":
            self.max_context = None

    # -- stepper ---------------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        if self.recurrent:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1,
                             **self._positions(pos))
            return out.logits[:, -1].float(), {"cache": out.cache_params, "pos": pos[:, -1]}
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), {"cache": out.past_key_values, "pos": pos[:, -1]}

    def prefix_reuse_pays(self) -> bool:
        return not self.recurrent  # transformers' Mamba would take the suffix one token per call

    def _positions(self, pos):
        return {"position_ids": pos} if self.model.config.model_type == "icr_hybrid" else {}

    def _recurrent_step(self, state, input_ids, attention_mask):
        n = input_ids.shape[1]
        block = attention_mask[:, -n:].bool()
        past = attention_mask.shape[1] - n
        logits = None
        for t in range(n):
            valid = block[:, t]
            saved = None if bool(valid.all()) else _recurrent_tensors(state["cache"], clone=True)
            pos = state["pos"] + valid.long()
            kw = self._positions(pos[:, None])
            if kw:
                kw["attention_mask"] = attention_mask[:, : past + t + 1]
            out = self.model(input_ids=input_ids[:, t:t + 1], cache_params=state["cache"], use_cache=True, **kw)
            if saved is not None:
                for cur, old in zip(_recurrent_tensors(state["cache"]), saved):
                    cur[~valid] = old[~valid]
            state["pos"] = pos
            step_logits = out.logits[:, -1].float()
            logits = step_logits if logits is None else torch.where(valid[:, None], step_logits, logits)
        return logits

    def step(self, state, input_ids, attention_mask):
        if self.recurrent:
            return self._recurrent_step(state, input_ids, attention_mask)
        block_mask = attention_mask[:, -input_ids.shape[1]:]
        pos = state["pos"][:, None] + block_mask.cumsum(-1)  # pads (right of the real tokens) are masked anyway
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                         past_key_values=state["cache"], use_cache=True)
        state["pos"] = pos.gather(1, last_real_index(block_mask)[:, None]).squeeze(1)
        return logits_at_last_real(out.logits, block_mask).float()

    def expand(self, state, n):
        cache = copy.deepcopy(state["cache"])
        _map_cache(cache, lambda t: t.repeat_interleave(n, dim=0))
        return {"cache": cache, "pos": state["pos"].repeat_interleave(n, dim=0)}

    def select(self, state, keep):
        _map_cache(state["cache"], lambda t: t.index_select(0, keep))
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


def _cache_layers(cache):
    """Every transformers Cache object inside a decoding state (the hybrid holds a pair of them)."""
    return [c for c in (cache if isinstance(cache, tuple) else (cache,)) if c is not None]


def _state_slots(layer):
    """(container, key) of each tensor a cache layer holds: KV tensors or conv/recurrent states."""
    slots = []
    for name in ("keys", "values", "conv_states", "recurrent_states"):
        val = getattr(layer, name, None)
        if isinstance(val, torch.Tensor):
            slots.append((layer, name))
        elif isinstance(val, dict):
            slots += [(val, k) for k, v in val.items() if isinstance(v, torch.Tensor)]
        elif isinstance(val, list):
            slots += [(val, i) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return slots


def _map_cache(cache, fn) -> None:
    """Apply a batch-dimension op (select rows, repeat rows) to every tensor of a cache, in place. Written
    here because transformers' linear-attention (Mamba) cache layers have no batch_select_indices."""
    for c in _cache_layers(cache):
        for layer in c.layers:
            for box, key in _state_slots(layer):
                if isinstance(box, (dict, list)):
                    box[key] = fn(box[key])
                else:
                    setattr(box, key, fn(getattr(box, key)))


def _recurrent_tensors(cache, clone: bool = False) -> list[torch.Tensor]:
    out = []
    for c in _cache_layers(cache):
        for layer in c.layers:
            for box, key in _state_slots(layer):
                if key in ("keys", "values"):
                    continue  # a padded position's KV entry is masked; only recurrent state needs restoring
                t = box[key] if isinstance(box, (dict, list)) else getattr(box, key)
                out.append(t.clone() if clone else t)
    return out
