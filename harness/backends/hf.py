"""transformers backend: any ``AutoModelForCausalLM`` checkpoint (Phi-1.5, Llama, GPT-2, ...)."""
from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import harness.models.istree  # noqa: F401  registers the trainer's model types (icr_hybrid) with the Auto classes
from harness import hub
from harness.backends import cpu_heap, fla_models, growing_cache, kept_positions, onednn_linear
from harness.backends.additive_mask import BuiltMask, additive_mask
from harness.backends.chunked_attention import SHARED_MIN, chunk_attention, known
from harness.backends.fused_activations import fuse_activations
from harness.backends.base import (
    BackendInfo,
    JoinsBatches,
    MergesRows,
    ScoresBlocks,
    ScoresText,
    probe_ids,
    resolve_device,
    resolve_dtype,
)
from harness.backends.families import (
    family_of,
    key_share,
    join_rows,
    map_rows,
    merge_rows,
    mergeable,
    recurrent_state,
    repeat_rows,
    restore_rows,
)
from harness.backends.generation import last_real_index, logits_at_last_real, shared_middles
from harness.backends.kv_decode_graphs import GraphedKVDecode, unsupported
from harness.backends.step import StepBackend
from harness.backends.tokenizer import load_tokenizer
from harness.ops import cpu_flash

log = logging.getLogger("harness")


class TransformersBackend(StepBackend, MergesRows, JoinsBatches, ScoresText, ScoresBlocks):
    """Any ``AutoModelForCausalLM`` checkpoint, stepped through its cache. How padding is kept out of each
    family's state (and so how freely it batches) comes from ``harness.backends.families``. A model passed in is
    changed in place: its Python-written tanh GELUs fused (``harness.backends.fused_activations``) and, on a CPU,
    a plain key/value family's attention set to chunk long query blocks and to read merged rows' shared front once
    a step (``harness.backends.chunked_attention``), its float32 linear layers run by the faster kernel there
    (``harness.backends.onednn_linear``), with a GELU that follows one in its epilogue where the model checks
    equal, and the process's freed memory kept (``harness.backends.cpu_heap``)."""

    name = "transformers"
    flash_attention = True  # on a CPU, its float32 attention may take the flash kernel (chunked_attention)
    keeps_positions = True  # on a CPU, a prefill's last layer for its kept positions only (kept_positions)
    graph_decode_capable = True  # attention families (harness.backends.kv_decode_graphs); others eager, logged

    def __init__(self, path: str, tokenizer: str | None = None, device: str = "auto", dtype: str = "auto",
                 model=None, tok=None, graph_decode: bool = False, compile_decode: bool = False):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.path = path
        self.tokenizer = tok if tok is not None else load_tokenizer(tokenizer or path)
        if model is None:
            fla_models.register_for(path, hub.load_kwargs(path))
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, **hub.load_kwargs(path))
        if fla_models.is_fla_type(model.config.model_type):
            fla_models.prepare_device(self.device)
        self.model = model.to(self.device).eval()
        self.fused = fuse_activations(self.model)
        self.family = family_of(self.model)
        self.max_context = getattr(self.model.config, "max_position_embeddings", None) \
            if self.family.max_context else None
        self.graphs, self.decode = None, "eager"
        # a family that takes a prepared additive 4D mask gets one built once a forward (harness.backends.additive_mask)
        why = unsupported(self.model, self.family)
        self.additive_masks = why is None
        self.chunked = None  # on a CPU, a plain key/value cache: long blocks attend in chunks (chunked_attention)
        if self.additive_masks:
            self.chunked = chunk_attention(self.model, self.device)
            if self.chunked:
                self.fused.append(self.chunked)
        self.attention = cpu_flash.identity(self.device, self.dtype).get("attention") if self.flash_attention else None
        self.linear = onednn_linear.identity(self.device, self.dtype).get("linear")
        for changed in (onednn_linear.use_onednn(self.model, self.device, self.dtype),
                        cpu_heap.keep_freed_memory(self.device)):
            if changed:
                self.fused.append(changed)
        if graph_decode:
            if self.device.type != "cuda":
                raise ValueError(f"--cuda-graphs needs a CUDA device (this run is on {self.device})")
            if why is None:
                self.graphs = GraphedKVDecode(self.model, compile=compile_decode)
            else:
                self.decode = f"eager ({why})"
                log.info("%s: decoding eagerly, not from CUDA graphs: %s", self.path, why)
        if folded := self.fold_gelu():
            self.fused.append(folded)
        if self.chunked and (kept := kept_positions.install(self.model, self.family, self._probe_prefill)):
            self.fused.append(kept)

    # -- what is exact here (harness.backends.planner decides with it) -----------------------------------
    def batches_exact(self) -> bool:
        return self.family.padding != "alone"

    def prefix_exact(self) -> bool:
        return self.family.copied_prefix_exact

    @torch.inference_mode()
    def tree_unsupported(self) -> str | None:
        """The prefix tree feeds each row alone after a copied state (unpadded), then merges rows: exact for a
        masked family, and for a restore family whose cached steps take a block in one call, where the family's
        segments equal a whole prefill (``Family.segments_exact``) and its cache's layers are ones
        ``merge_rows`` knows."""
        fam = self.family
        if why := self._rows_unsupported("rows cannot be merged in"):
            return why
        if not (fam.padding == "masked" or fam.block_steps):
            return f"{fam.name}'s cached steps take one token at a time"
        if not fam.segments_exact:
            return (f"{fam.name}: a prompt prefilled in segments is not the prompt prefilled whole (measured by "
                    "tests/test_families.py)")
        return None if self._cache_mergeable() else f"{fam.name}'s cache layers cannot be merged across rows"

    def _rows_unsupported(self, what: str) -> str | None:
        """Why this family's cached rows cannot be moved between batches at all (the tree's merges and
        continuous batching's joins both need it), or None."""
        fam = self.family
        if fam.padding == "alone" or fam.module_state:
            return f"{fam.name} runs each sample alone"
        if fam.own_cache:
            return f"{fam.name} builds its own cache class, which {what}"
        return None

    @torch.inference_mode()
    def _cache_mergeable(self) -> bool:
        if getattr(self, "_mergeable", None) is None:
            ids = torch.full((1, 2), self.tokenizer.eos_token_id, device=self.device)
            cache = self.prefill(ids, torch.ones_like(ids))[1]["cache"]
            self._mergeable, self._key_share = mergeable(cache), key_share(cache)
            self._in_slots = growing_cache.in_slots(cache)
        return self._mergeable

    def merge(self, states, lengths, shared=0):
        state = {"cache": merge_rows([s["cache"] for s in states], list(lengths), shared),
                 "pos": torch.cat([s["pos"] for s in states])}
        if shared:  # the steps' attention reads the shared front once for all rows (chunked_attention.known)
            state["shared"] = shared
        return state

    def row_slots(self, rows, width):
        """Where rows merge with their front shared (a CPU's growing caches): one buffer a layer, every row's
        prefill writing in place."""
        if not (self.merges_shared_front() and self.graphs is None and self._cache_mergeable() and self._in_slots):
            return None
        return growing_cache.RowSlots(rows, width)

    def place(self, state, slots, row):
        growing_cache.place(state["cache"], slots, row)

    def merge_slots(self, states, seqs, shared, slots):
        """Where rows share a middle long enough to read once (``chunked_attention.SHARED_MIN``), the decoding
        pass reads it once for them (``cpu_flash.Middles``)."""
        state = {"cache": growing_cache.join_slots([s["cache"] for s in states], [len(s) for s in seqs], slots),
                 "pos": torch.cat([s["pos"] for s in states])}
        if shared:
            state["shared"] = shared
            pairs = shared_middles(seqs, shared, SHARED_MIN)
            if any(owner != row for row, (owner, _) in enumerate(pairs)):
                state["middles"] = cpu_flash.Middles.of(pairs, shared)
        return state

    def merges_shared_front(self) -> bool:
        """On a CPU, where attention is ``chunked_sdpa`` (which reads a shared front once) and a mask anywhere
        in the keys is masked in every layer; elsewhere the pads stay in front."""
        return self.chunked is not None and self.family.padding == "masked"

    def join_unsupported(self) -> str | None:
        """New rows join a running batch where its batches are exact, its cache's layers are ones ``join_rows``
        knows, and padding put in front of its keys is masked in its cached steps."""
        fam = self.family
        if why := self._rows_unsupported("batches cannot be joined in"):
            return why
        if self.graphs is not None:
            return "the decode graphs keep the batch in fixed buffers"
        if not self._cache_mergeable():
            return f"{fam.name}'s cache layers cannot be joined across batches"
        if self._key_share and not fam.step_mask:
            return f"{fam.name}'s cached steps take no attention mask: joined keys' pads would be attended"
        return None

    def key_share(self) -> float:
        self._cache_mergeable()
        return self._key_share

    def join(self, states, cuts):
        return {"cache": join_rows([s["cache"] for s in states], list(cuts)),
                "pos": torch.cat([s["pos"] for s in states])}

    # -- stepper ---------------------------------------------------------------------------------
    def _forward(self, cache, input_ids, attention_mask, pos, shared: int = 0, middles=None, **kw):
        fam = self.family
        args = dict(input_ids=input_ids, use_cache=True, **kw)
        built = None
        if attention_mask is not None:
            args["attention_mask"] = attention_mask
            if self.additive_masks and attention_mask.dim() == 2:
                args["attention_mask"] = additive_mask(attention_mask, input_ids.shape[1], self.model.dtype)
                if args["attention_mask"].dim() == 4:  # where attention may skip adding it
                    built = BuiltMask(args["attention_mask"], attention_mask)
        if fam.positions:
            args["position_ids"] = pos
        if cache is not None:
            args[fam.cache_arg] = cache
        with known(shared, built, kw.get("logits_to_keep", 0), middles):
            out = self.model(**args)
        return out.logits, (getattr(out, fam.cache_out) if fam.cache_out else cache)

    def prefill(self, input_ids, attention_mask):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        if (self.family.cache_out is None or self.family.padding == "masked") and not self.family.own_cache:
            cache = DynamicCache(config=self.model.config)
            growing_cache.install(cache)  # decode steps write in place instead of copying the cache
        logits, cache = self._forward(cache, input_ids, attention_mask, pos, logits_to_keep=1)
        return logits[:, -1].float(), {"cache": cache, "pos": pos[:, -1]}

    def _probe_prefill(self) -> torch.Tensor:
        """Two rows' prefill logits, one row left-padded: what ``kept_positions`` checks itself on."""
        ids = probe_ids(self, 2, 40)
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
        with torch.inference_mode():
            return self.prefill(ids, mask)[0]

    def step(self, state, input_ids, attention_mask):
        n = input_ids.shape[1]
        if self.graphs is not None:
            logits = self.graphs(state, input_ids, attention_mask)
            if logits is not None:
                return logits
        if n > 1 and self.feeds_token_by_token(attention_mask[:, -n:].sum(1).tolist()):
            return self._token_by_token(state, input_ids, attention_mask)
        return self._block(state, input_ids, attention_mask)

    def feeds_token_by_token(self, widths):
        """A family that does not mask padding takes a block in one call only where every row's is as wide, and
        its cached steps take blocks at all (``Family.block_steps``)."""
        fam = self.family
        return fam.padding != "masked" and (len(set(widths)) > 1 or not fam.block_steps)

    def _block(self, state, input_ids, attention_mask):
        """One call for the whole right-padded block (exact when the family masks padding, or no row is padded)."""
        block_mask = attention_mask[:, -input_ids.shape[1]:]
        pos = state["pos"][:, None] + block_mask.cumsum(-1)  # pads (right of the real tokens) are masked anyway
        logits, state["cache"] = self._forward(state["cache"], input_ids,
                                               attention_mask if self.family.step_mask else None, pos,
                                               shared=state.get("shared", 0), middles=state.get("middles"))
        state["pos"] = pos.gather(1, last_real_index(block_mask)[:, None]).squeeze(1)
        return logits_at_last_real(logits, block_mask).float()

    def extend(self, state, ids, past):
        """One call for the run of tokens (``tree_unsupported`` admits only families where that is exact), keeping
        the last position's logits only."""
        n = len(ids)
        t = torch.tensor([list(ids)], device=self.device)
        pos = state["pos"][:, None] + torch.arange(1, n + 1, device=self.device)
        mask = torch.ones((1, past + n), dtype=torch.long, device=self.device) if self.family.step_mask else None
        logits, state["cache"] = self._forward(state["cache"], t, mask, pos, logits_to_keep=1)
        state["pos"] = pos[:, -1]
        return logits[:, -1].float()

    def block_logits(self, state, input_ids, attention_mask):
        """Every position's logits of a right-padded block (families whose blocks are masked in every layer)."""
        if not self.family.copied_prefix_exact:
            raise NotImplementedError(f"{self.family.name}: a block after a copied state is not exact")
        block_mask = attention_mask[:, -input_ids.shape[1]:]
        pos = state["pos"][:, None] + block_mask.cumsum(-1)
        logits, state["cache"] = self._forward(state["cache"], input_ids,
                                               attention_mask if self.family.step_mask else None, pos)
        return logits.float()

    def _token_by_token(self, state, input_ids, attention_mask):
        """A block fed one token per call; rows whose block has ended get their recurrent state put back."""
        n = input_ids.shape[1]
        block = attention_mask[:, -n:].bool()
        past = attention_mask.shape[1] - n
        logits = None
        for t in range(n):
            valid = block[:, t]
            saved = None if bool(valid.all()) else recurrent_state(state["cache"], clone=True)
            pos = state["pos"] + valid.long()
            mask = attention_mask[:, : past + t + 1] if self.family.step_mask else None
            step_logits, state["cache"] = self._forward(state["cache"], input_ids[:, t:t + 1], mask, pos[:, None])
            if saved is not None:
                restore_rows(state["cache"], saved, ~valid)
            state["pos"] = torch.where(valid, pos, state["pos"])
            step_logits = step_logits[:, -1].float()
            logits = step_logits if logits is None else torch.where(valid[:, None], step_logits, logits)
        return logits

    def sequence_logits(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits

    def expand(self, state, n):
        return {"cache": repeat_rows(state["cache"], n), "pos": state["pos"].repeat_interleave(n, dim=0)}

    def select(self, state, keep):
        map_rows(state["cache"], lambda t: t.index_select(0, keep))
        state["pos"] = state["pos"].index_select(0, keep)
        if state.get("middles") is not None:
            state["middles"] = state["middles"].select(keep.tolist())
        return state

    def bytes_per_token(self) -> int:
        cfg = self.model.config
        layers = getattr(cfg, "num_hidden_layers", 1)
        heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 1)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // getattr(cfg, "num_attention_heads", 1)
        elt = torch.finfo(self.dtype).bits // 8
        # K and V for every layer, plus the hidden state and the logits row of the step that uses them.
        return 2 * layers * heads * head_dim * elt + 8 * cfg.hidden_size * elt

    def describe(self) -> BackendInfo:
        return BackendInfo(backend=self.name, device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                           model_class=type(self.model).__name__, max_context=self.max_context,
                           family=self.family.name,
                           decode=self.graphs.describe() if self.graphs is not None else self.decode,
                           parameters=sum(p.numel() for p in self.model.parameters()), fused=self.fused or None,
                           linear=self.linear, attention=self.attention, extra={"padding": self.family.padding})
