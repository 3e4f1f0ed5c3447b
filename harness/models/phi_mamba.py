"""Phi-Mamba and Hybrid-Phi-Mamba (MOHAWK, arXiv 2408.10189), written for this project in plain PyTorch.

Loads the ``goombalab/Phi-Mamba`` and ``goombalab/Hybrid-Phi-Mamba`` checkpoints with strict key matching.
transformers has no class for them and the authors' code needs CUDA kernels and torch 2.1, so the model is
here; mamba-ssm's Triton kernels run the prompt scan and the decode step when present on a GPU
(``harness.ops.kernels`` decides), and everything runs on the CPU without.

Architecture (parameter names follow the checkpoints):
  backbone.embedding → N blocks → backbone.final_layernorm → lm_head (with bias)
  block: h + mixer(LN(h)) + mlp(LN(h))  (Phi's parallel block; one LayerNorm, ``input_layernorm``)
  mixer: discrete Mamba-2 (``mixer.in_proj``, ``conv1d``, ``z_bias``, ``D``, ``out_proj``), or in the hybrid
         Phi attention (``mixer.self_attn.{q,k,v}_proj``, ``dense``; partial rotary).
Discrete Mamba-2, per head (P = head dim, N = d_state):
  [xBC, z, a] = in_proj(u);  xBC = conv1d(xBC) (causal, no activation);  split xBC → x, B, C
  h_t = exp(-softplus(a_t)) · h_{t-1} + x_t ⊗ B_t        y_t = C_t · h_t + D · x_t
  out = out_proj(y · silu(z + z_bias))
Padding: a padded position leaves the state untouched (decay 1, no input, zero conv input), so a left-padded
batch gives every row what it would get alone; lm-eval's mamba backend ignores the mask, this does not.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness import hub
from harness.ops import kernels
from harness.models.masks import block_attention_mask

log = logging.getLogger("harness")

MAMBA_CORE = "modules.mixers.discrete_mamba2"
ATTN_CORE = "modules.mixers.phi_attention"
# goombalab/phi-mamba builds every attention layer from Phi-1.5's defaults, whatever a checkpoint's core_input
# says; the project's own checkpoints (tiny test models) mark that their core_input is to be honoured.
PHI15_ATTENTION = {"num_attention_heads": 32, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                   "max_position_embeddings": 2048}
OWN_MARKER = "icr_harness"


# ------------------------------------------------------------------------------------------- config
@dataclass
class PhiMambaConfig:
    vocab_size: int = 51200
    pad_vocab_size_multiple: int = 8
    d_model: int = 2048
    n_layer: int = 24
    attn_layers: list[int] = field(default_factory=list)
    # discrete Mamba-2 mixer
    d_state: int = 64
    n_qk_heads: int = 32
    n_v_heads: int = 32
    d_conv: int = 4
    expand: int = 1
    chunk_size: int = 128
    conv_bias: bool = True
    # Phi attention (hybrid layers)
    num_attention_heads: int = 32
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    # attention settings a goombalab config.json asked for that the official code (and so this one) ignores
    ignored_core_input: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def padded_vocab(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size + (-self.vocab_size % m)

    @classmethod
    def tiny(cls, vocab_size: int, d_model: int = 64, n_layer: int = 2, attn_layers=(), chunk_size: int = 16):
        return cls(vocab_size=vocab_size, d_model=d_model, n_layer=n_layer, attn_layers=list(attn_layers),
                   d_state=16, n_qk_heads=4, n_v_heads=4, num_attention_heads=4, chunk_size=chunk_size,
                   max_position_embeddings=1 << 20)

    # The checkpoints' config.json: LanguageModel / MixerModel / Block1..BlockK, each block a run of layers.
    @classmethod
    def from_goombalab(cls, cfg: dict) -> "PhiMambaConfig":
        try:
            lm, mm = cfg["LanguageModel"]["input"], cfg["MixerModel"]["input"]
            blocks = [cfg[k] for k in sorted((k for k in cfg if k.startswith("Block")), key=lambda k: int(k[5:]))]
        except (KeyError, ValueError) as e:
            raise ValueError(f"not a Phi-Mamba config (LanguageModel/MixerModel/BlockN expected): {e}") from e
        out = cls(vocab_size=lm["vocab_size"], pad_vocab_size_multiple=lm.get("pad_vocab_size_multiple", 8),
                  d_model=mm["d_model"], n_layer=mm["n_layer"])
        layer, ignored = 0, {}
        honour_core = bool(cfg.get(OWN_MARKER, {}).get("attention_from_core_input"))
        for b in blocks:
            core = b.get("core_input", {})
            if b["CoreType"] == ATTN_CORE:
                out.attn_layers += list(range(layer, layer + b["n_layers"]))
                for k, default in PHI15_ATTENTION.items():
                    if honour_core and k in core:
                        setattr(out, k, core[k])
                    elif k in core and core[k] != default:
                        ignored[k] = core[k]
            elif b["CoreType"] == MAMBA_CORE:
                for k in ("d_state", "n_qk_heads", "n_v_heads", "d_conv", "expand", "chunk_size", "conv_bias"):
                    if k in core:
                        setattr(out, k, core[k])
                if core.get("activation", "identity") != "identity" or core.get("bias", False):
                    raise ValueError("only the checkpoints' discrete Mamba-2 (identity activation, no bias) is supported")
            else:
                raise ValueError(f"unknown CoreType {b['CoreType']!r} in Phi-Mamba config")
            layer += b["n_layers"]
        if layer != out.n_layer:
            raise ValueError(f"blocks hold {layer} layers but MixerModel.n_layer is {out.n_layer}")
        if ignored:
            log.warning("hybrid attention is built as goombalab/phi-mamba builds it, from Phi-1.5's defaults (%s); "
                        "config.json's core_input also says %s, which the official code ignores as well",
                        ", ".join(f"{k}={v}" for k, v in PHI15_ATTENTION.items()),
                        ", ".join(f"{k}={v}" for k, v in ignored.items()))
        out.ignored_core_input = ignored
        return out

    def to_goombalab(self) -> dict:
        mamba_core = {"d_state": self.d_state, "n_v_heads": self.n_v_heads, "n_qk_heads": self.n_qk_heads,
                      "d_conv": self.d_conv, "conv_bias": self.conv_bias, "expand": self.expand,
                      "chunk_size": self.chunk_size, "activation": "identity", "bias": False}
        attn_core = {"num_attention_heads": self.num_attention_heads, "rope_theta": self.rope_theta,
                     "partial_rotary_factor": self.partial_rotary_factor,
                     "max_position_embeddings": self.max_position_embeddings}
        cfg = {"model_type": "phi_mamba",  # read by the project's vLLM plugin (harness/backends/vllm_plugin.py)
               OWN_MARKER: {"attention_from_core_input": True},
               "LanguageModel": {"input": {"vocab_size": self.vocab_size,
                                           "pad_vocab_size_multiple": self.pad_vocab_size_multiple}},
               "MixerModel": {"input": {"d_model": self.d_model, "n_layer": self.n_layer,
                                        "lm_head_prenorm": "layer"}}}
        runs: list[list] = []  # consecutive layers of one kind form one BlockN entry
        for i in range(self.n_layer):
            kind = ATTN_CORE if i in self.attn_layers else MAMBA_CORE
            if runs and runs[-1][0] == kind:
                runs[-1][1] += 1
            else:
                runs.append([kind, 1])
        for n, (kind, count) in enumerate(runs, 1):
            cfg[f"Block{n}"] = {"n_layers": count, "BlockType": "modules.phi_block",
                                "block_input": {"resid_dropout": 0.0}, "CoreType": kind,
                                "core_input": mamba_core if kind == MAMBA_CORE else attn_core}
        return cfg


# ---------------------------------------------------------------------------------------- reference scans
def ssd_chunked(x, log_a, B, C, h0, chunk: int):
    """Chunked parallel scan (the SSD form of Mamba-2) in plain PyTorch.

    x [b, l, h, p]; log_a [b, l, h] (<= 0); B, C [b, l, h, n]; h0 [b, h, p, n]. Returns y [b, l, h, p] and the
    final state. Within a chunk the output is a masked (decay-weighted) attention-like product; between chunks
    the state is carried by the plain recurrence, so the cost is linear in length."""
    b, l, h, p = x.shape
    pad = -l % chunk
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        log_a = F.pad(log_a, (0, 0, 0, pad))
    nc = x.shape[1] // chunk
    x, B, C = (t.reshape(b, nc, chunk, h, -1) for t in (x, B, C))
    log_a = log_a.reshape(b, nc, chunk, h).permute(0, 1, 3, 2)  # b c h q
    cum = torch.cumsum(log_a, dim=-1)  # b c h q
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    seg = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))  # b c h q k
    decay = torch.exp(seg)
    scores = torch.einsum("bcqhn,bckhn->bchqk", C, B) * decay
    y = torch.einsum("bchqk,bckhp->bcqhp", scores, x)
    # contribution of each chunk's inputs to its final state
    to_end = torch.exp(cum[..., -1:] - cum)  # b c h q
    chunk_states = torch.einsum("bchq,bcqhn,bcqhp->bchpn", to_end, B, x)
    states, hcur = [], h0
    chunk_decay = torch.exp(cum[..., -1])  # b c h
    for c in range(nc):
        states.append(hcur)
        hcur = hcur * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    prev = torch.stack(states, dim=1)  # b c h p n: state entering each chunk
    y = y + torch.einsum("bcqhn,bchpn,bchq->bcqhp", C, prev, torch.exp(cum))
    return y.reshape(b, nc * chunk, h, p)[:, :l], hcur


def ssd_step(x, log_a, B, C, h):
    """One recurrent step: x [b, h, p], log_a [b, h], B, C [b, h, n], h [b, h, p, n]."""
    h = h * torch.exp(log_a)[..., None, None] + x[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", h, C), h


# ------------------------------------------------------------------------------------------- layers
class DiscreteMamba2(nn.Module):
    def __init__(self, cfg: PhiMambaConfig):
        super().__init__()
        self.cfg = cfg
        d_inner = cfg.expand * cfg.d_model
        self.d_inner, self.h, self.hqk, self.n = d_inner, cfg.n_v_heads, cfg.n_qk_heads, cfg.d_state
        self.p = d_inner // cfg.n_v_heads
        self.conv_dim = d_inner + 2 * cfg.n_qk_heads * cfg.d_state
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner + 2 * cfg.n_qk_heads * cfg.d_state + cfg.n_v_heads, bias=False)
        self.z_bias = nn.Parameter(torch.zeros(d_inner))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.d_conv, groups=self.conv_dim, bias=cfg.conv_bias,
                                padding=cfg.d_conv - 1)
        self.D = nn.Parameter(torch.ones(cfg.n_v_heads))
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=False)

    def init_state(self, batch: int, device, dtype) -> dict:
        return {"conv": torch.zeros(batch, self.conv_dim, self.cfg.d_conv - 1, device=device, dtype=dtype),
                "ssm": torch.zeros(batch, self.h, self.p, self.n, device=device, dtype=torch.float32)}

    def forward(self, u, mask, state: dict, last: torch.Tensor, scan: str = "auto"):
        """u [b, l, d]; mask [b, l] (1 = real); state is read and replaced; ``last`` [b] = last real index."""
        bsz, l, _ = u.shape
        k = self.cfg.d_conv
        xbc, z, a = self.in_proj(u).split([self.conv_dim, self.d_inner, self.h], dim=-1)
        m = mask.bool()
        xbc = torch.where(m[..., None], xbc, 0.0)
        full = torch.cat([state["conv"].to(xbc.dtype), xbc.transpose(1, 2)], dim=2)  # b c (k-1+l)
        w = self.conv1d.weight.squeeze(1)  # c k
        # The depthwise causal convolution as k shifted products, not F.conv1d: on CUDA that is cuDNN, which runs
        # float32 in TF32 by default and picks its algorithm by batch shape, so a row's result would depend on
        # its batch (seen on an H100). Elementwise products are exact float32 and the same in any batch.
        conv = full[..., :l] * w[:, :1]
        for j in range(1, k):
            conv = conv + full[..., j:j + l] * w[:, j:j + 1]
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias[:, None]
        idx = (last[:, None] + 1 + torch.arange(k - 1, device=u.device))[:, None, :].expand(-1, self.conv_dim, -1)
        state["conv"] = full.gather(2, idx)
        x, B, C = conv.transpose(1, 2).split([self.d_inner, self.hqk * self.n, self.hqk * self.n], dim=-1)
        x = x.reshape(bsz, l, self.h, self.p)
        B = B.reshape(bsz, l, self.hqk, self.n).repeat_interleave(self.h // self.hqk, dim=2)
        C = C.reshape(bsz, l, self.hqk, self.n).repeat_interleave(self.h // self.hqk, dim=2)
        log_a = torch.where(m[..., None], -F.softplus(a.float()), 0.0)  # a pad neither decays nor adds
        x_in = torch.where(m[..., None, None], x, 0.0).float()
        if l == 1:
            y, state["ssm"] = self._step(x_in[:, 0], log_a[:, 0], B[:, 0].float(), C[:, 0].float(), state["ssm"],
                                         scan)
            y = y[:, None]
        else:
            y, state["ssm"] = self._scan(x_in, log_a, B.float(), C.float(), state["ssm"], scan)
        y = y.to(x.dtype) + self.D[:, None] * x
        return self.out_proj(y.reshape(bsz, l, self.d_inner) * F.silu(z + self.z_bias))

    # mamba-ssm's kernels take dt and A and form exp(A dt) and dt * B x; with A = -1 and dt = -log_a that is our
    # decay, and feeding x / dt gives our input term (dt = 0 on pads, where x is 0 too).
    def _scan(self, x, log_a, B, C, h0, scan):
        ops = kernels.require(scan, x)
        if ops is None:
            return ssd_chunked(x, log_a, B, C, h0, self.cfg.chunk_size)
        dt = (-log_a).contiguous()
        x, a = x / dt.clamp_min(1e-12)[..., None], -torch.ones(self.h, device=x.device)
        b, l, chunk = x.shape[0], x.shape[1], self.cfg.chunk_size
        chunks = -(-l // chunk)
        # the largest per-row extent of an input or intermediate (chunk states, the chunk-by-chunk C.B products)
        per_row = max(l * self.h * max(self.p, self.n), chunks * self.h * max(self.p * self.n, chunk * chunk))
        ys, hs = [], []
        for rows in kernels.int32_safe_rows(b, per_row):
            kernels.CALLS["chunk_scan"] += 1
            y, h = ops.chunk_scan(x[rows], dt[rows], a, B[rows], C[rows], chunk_size=chunk, initial_states=h0[rows],
                                  return_final_states=True)
            ys.append(y)
            hs.append(h)
        return (ys[0], hs[0]) if len(ys) == 1 else (torch.cat(ys), torch.cat(hs))

    def _step(self, x, log_a, B, C, h, scan):
        ops = kernels.require(scan, x)
        if ops is None:
            return ssd_step(x, log_a, B, C, h)
        dt = (-log_a)[..., None].expand_as(x).contiguous()
        x, a = x / dt.clamp_min(1e-12), -torch.ones(self.h, self.p, self.n, device=x.device)
        h = h.clone()  # updated in place by the kernel; a copied prefix state must stay intact
        zeros = torch.zeros(self.h, self.p, device=x.device, dtype=x.dtype)
        ys = []
        for rows in kernels.int32_safe_rows(x.shape[0], self.h * self.p * self.n):
            kernels.CALLS["state_update"] += 1
            # D and dt_bias are passed as zeros (they add nothing): mamba-ssm 2.3.2's launcher fails on None for
            # either (found by the CPU-interpreter test). D x is added outside, as in the reference path.
            ys.append(ops.state_update(h[rows], x[rows], dt[rows], a, B[rows], C[rows], D=zeros, dt_bias=zeros))
        return (ys[0] if len(ys) == 1 else torch.cat(ys)), h


class PhiAttentionMixer(nn.Module):
    """Phi-1.5 attention (partial rotary, biased projections) with a preallocated KV cache: keys and values are
    written in place and the buffer grows by a quarter (at least 256 positions) when full, so a decode step
    does not copy the whole cache (a ``torch.cat`` per step makes decoding quadratic in context length) and
    at most a quarter of it is spare. A state with a ``write_at`` key is the fixed-capacity form CUDA graphs
    replay (see ``_static_step``)."""

    def __init__(self, cfg: PhiMambaConfig):
        super().__init__()
        self.self_attn = nn.Module()
        d = cfg.d_model
        for name in ("q_proj", "k_proj", "v_proj", "dense"):
            setattr(self.self_attn, name, nn.Linear(d, d, bias=True))
        self.heads = cfg.num_attention_heads
        self.head_dim = d // self.heads
        self.rot = int(self.head_dim * cfg.partial_rotary_factor)
        self.theta = cfg.rope_theta
        self.register_buffer("inv_freq", self.rope_frequencies(), persistent=False)

    def rope_frequencies(self, device=None) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.rot, 2, dtype=torch.float32, device=device) / self.rot))

    def init_state(self, batch: int, device, dtype, capacity: int = 0) -> dict:
        empty = torch.zeros(batch, self.heads, capacity, self.head_dim, device=device, dtype=dtype)
        return {"k": empty, "v": empty.clone(), "len": 0}

    def _rotate(self, t, pos):
        freqs = pos[..., None].float() * self.inv_freq  # b l r/2
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # b 1 l r
        cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
        r, rest = t[..., : self.rot], t[..., self.rot:]
        half = self.rot // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
        return torch.cat([r * cos + rotated * sin, rest], dim=-1)

    def forward(self, u, full_mask, state: dict, pos):
        b, l, _ = u.shape
        sa = self.self_attn
        q, k, v = (getattr(sa, n)(u).view(b, l, self.heads, self.head_dim).transpose(1, 2)
                   for n in ("q_proj", "k_proj", "v_proj"))
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        if "write_at" in state:
            return sa.dense(self._static_step(q, k, v, state).transpose(1, 2).reshape(b, l, -1))
        past, end = state["len"], state["len"] + l
        if end > state["k"].shape[2]:
            cap = state["k"].shape[2]
            grown = max(end, cap + max(256, cap // 4))
            for name in ("k", "v"):
                buf = state[name].new_zeros(b, self.heads, grown, self.head_dim)
                buf[:, :, :past] = state[name][:, :, :past]
                state[name] = buf
        state["k"][:, :, past:end] = k
        state["v"][:, :, past:end] = v
        state["len"] = end
        k, v = state["k"][:, :, :end], state["v"][:, :, :end]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=block_attention_mask(full_mask, l))
        return sa.dense(out.transpose(1, 2).reshape(b, l, -1))

    @staticmethod
    def _static_step(q, k, v, state: dict) -> torch.Tensor:
        """One token into a fixed-capacity cache (CUDA graphs, harness.models.decode_graphs): written at the
        device-side index ``write_at``, attended over the whole capacity through the ``visible`` mask, so the
        shapes and addresses never change."""
        if q.shape[2] != 1:
            raise ValueError("the fixed-capacity KV cache takes one token per step")
        state["k"].index_copy_(2, state["write_at"], k)
        state["v"].index_copy_(2, state["write_at"], v)
        return F.scaled_dot_product_attention(q, state["k"], state["v"], attn_mask=state["visible"][:, None, None])


class PhiMLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.GELU(approximate="tanh")  # a module, so a CPU run can fold it into fc1 (fused_activations)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: PhiMambaConfig, attention: bool):
        super().__init__()
        self.attention = attention
        self.input_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mixer = PhiAttentionMixer(cfg) if attention else DiscreteMamba2(cfg)
        self.mlp = PhiMLP(cfg.d_model)


class Backbone(nn.Module):
    def __init__(self, cfg: PhiMambaConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i in cfg.attn_layers) for i in range(cfg.n_layer))
        self.final_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


# -------------------------------------------------------------------------------------------- model
class PhiMambaState:
    """Decoding state: per layer a fixed-size (conv window + SSM state) or, for attention, a KV cache."""

    def __init__(self, layers: list[dict], pos: torch.Tensor):
        self.layers, self.pos = layers, pos  # pos: last position id per row

    def select(self, keep: torch.Tensor) -> "PhiMambaState":
        self.layers = [{k: v.index_select(0, keep) if torch.is_tensor(v) else v for k, v in s.items()}
                       for s in self.layers]
        self.pos = self.pos.index_select(0, keep)
        return self

    def repeat(self, n: int) -> "PhiMambaState":
        """A new state with this (one-row) state copied into ``n`` rows (KV buffers without their spare room, so a
        kept copy holds what ``nbytes`` says)."""
        def rows(s: dict, k: str, v):
            if not torch.is_tensor(v):
                return v
            return (v[:, :, :s["len"]] if k in ("k", "v") else v).repeat_interleave(n, dim=0)

        return PhiMambaState([{k: rows(s, k, v) for k, v in s.items()} for s in self.layers],
                             self.pos.repeat_interleave(n, dim=0))

    @staticmethod
    def merge(states: list["PhiMambaState"], lengths: list[int]) -> "PhiMambaState":
        """One batch from one-row states of ``lengths`` tokens: each KV cache right-aligned in a buffer as long as
        the longest (its left pads hidden by the attention mask), recurrent state stacked; a join of one-row
        batches (``join``)."""
        width = max(lengths)
        return PhiMambaState.join(states, [(n, 0, width - n) for n in lengths])

    @staticmethod
    def join(states: list["PhiMambaState"], cuts: list[tuple[int, int, int]]) -> "PhiMambaState":
        """One batch from running batches' states, in order; each batch's (width, cut, pad) as
        ``harness.backends.generation.join_masks`` gives it: of its ``width`` cached positions the first ``cut``
        dropped (masked in all its rows), ``pad`` zeros put in front (masked); recurrent state stacked. Consumes
        ``states`` layer by layer, so the batches and the joined one are not held twice over."""
        layers = []
        for i in range(len(states[0].layers)):
            per_batch = [s.layers[i] for s in states]
            for s in states:
                s.layers[i] = None
            if "len" in per_batch[0]:
                if any(s["len"] != width for s, (width, _, _) in zip(per_batch, cuts)):
                    raise ValueError("a state's cached positions do not match its attention mask (or a row's, its "
                                     "tokens)")
                kv = {name: torch.cat([F.pad(s[name][:, :, cut:s["len"]], (0, 0, pad, 0))
                                       for s, (_, cut, pad) in zip(per_batch, cuts)]) for name in ("k", "v")}
                layers.append({**kv, "len": kv["k"].shape[2]})
            else:
                layers.append({k: torch.cat([s[k] for s in per_batch]) for k in per_batch[0]})
        return PhiMambaState(layers, torch.cat([s.pos for s in states]))

    def nbytes(self) -> int:
        """Bytes of state in use: the recurrent state, and the filled part of each KV buffer."""
        total = 0
        for s in self.layers:
            for name, v in s.items():
                if torch.is_tensor(v):
                    total += (v[:, :, : s["len"]] if name in ("k", "v") else v).numel() * v.element_size()
        return total


class PhiMambaForCausalLM(nn.Module):
    def __init__(self, config: PhiMambaConfig):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab, bias=True)
        self.scan = "auto"  # the Mamba layers' scan: auto, kernel (mamba-ssm's Triton kernels) or torch

    def init_state(self, batch: int, device=None, dtype=None) -> PhiMambaState:
        device = device or self.lm_head.weight.device
        dtype = dtype or self.lm_head.weight.dtype
        return PhiMambaState([blk.mixer.init_state(batch, device, dtype) for blk in self.backbone.layers],
                             torch.full((batch,), -1, dtype=torch.long, device=device))

    def forward(self, input_ids, attention_mask=None, state: PhiMambaState | None = None, logits_to_keep: int = 0):
        """``attention_mask`` covers the state's past and this block ([b, past + l]; default all ones).
        Returns (logits, state); the state is updated in place. Blocks after the first are right-padded."""
        b, l = input_ids.shape
        if state is None:
            state = self.init_state(b)
        if attention_mask is None:
            past = state.layers[self.config.attn_layers[0]]["len"] if self.config.attn_layers else 0
            attention_mask = torch.ones(b, past + l, dtype=torch.long, device=input_ids.device)
        block = attention_mask[:, -l:]
        pos = state.pos[:, None] + block.cumsum(-1)
        last = (block * torch.arange(1, l + 1, device=block.device)).argmax(-1)  # last real index per row
        h = self.backbone.embedding(input_ids)
        for blk, s in zip(self.backbone.layers, state.layers):
            x = blk.input_layernorm(h)
            if blk.attention:
                mixed = blk.mixer(x, attention_mask, s, pos.clamp_min(0))
            else:
                mixed = blk.mixer(x, block, s, last, self.scan)
            h = h + mixed + blk.mlp(x)
        state.pos = pos.gather(1, last[:, None]).squeeze(1)
        h = self.backbone.final_layernorm(h if not logits_to_keep else h[:, -logits_to_keep:])
        return self.lm_head(h).float(), state

    # ---------------------------------------------------------------------------------- checkpoints
    def save_pretrained(self, path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_goombalab(), indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype=torch.float32, device="cpu") -> "PhiMambaForCausalLM":
        folder = _resolve_folder(name_or_path)
        cfg = PhiMambaConfig.from_goombalab(json.loads((folder / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(cfg)
        state = _read_weights(folder)
        check_keys(model, state, str(folder))
        model.load_state_dict(state, strict=True, assign=True)
        model.backbone.layers.apply(_rebuild_buffers)
        return model.to(device=device, dtype=dtype).eval()


def _rebuild_buffers(module):
    """Non-persistent buffers (rotary frequencies) were created on the meta device; compute them for real."""
    if isinstance(module, PhiAttentionMixer):
        module.inv_freq = module.rope_frequencies(device="cpu")


def check_keys(model: nn.Module, state: dict, where: str) -> None:
    """Strict loading with a readable error: every checkpoint tensor used, none missing, shapes equal."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    bad = sorted(k for k in set(want) & set(state) if tuple(state[k].shape) != want[k])
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if extra:
            parts.append(f"unexpected in the checkpoint: {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))
        if bad:
            parts.append("shape mismatch: " + ", ".join(f"{k} {tuple(state[k].shape)} vs {want[k]}" for k in bad[:8]))
        raise ValueError(f"checkpoint {where} does not match its config.json; " + "; ".join(parts))


def check_checkpoint(cfg: PhiMambaConfig, folder: Path | None) -> None:
    """Raise ValueError where ``folder``'s weights (names and shapes; safetensors files are read from their headers,
    no tensor loaded) do not fit the model ``cfg`` describes. For a check before another engine loads them."""
    if folder is None:
        raise ValueError("its files are not here (a local folder or the HF cache)")
    st = sorted(folder.glob("*.safetensors"))
    if st:
        from safetensors import safe_open

        shapes = {}
        for f in st:
            with safe_open(str(f), "pt") as handle:
                shapes.update({k: handle.get_slice(k).get_shape() for k in handle.keys()})
        state = {k: torch.empty(v, device="meta") for k, v in shapes.items()}
    else:
        state = {k: v.to("meta") for k, v in _read_weights(folder).items()}
    with torch.device("meta"):
        model = PhiMambaForCausalLM(cfg)
    check_keys(model, state, str(folder))


def _resolve_folder(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.bin"],
                                      **hub.load_kwargs(name_or_path)))
    except Exception as e:
        raise OSError(f"could not find {name_or_path!r} locally, in the HF cache or on the hub ({type(e).__name__}: "
                      f"{e}). Download it where the hub is reachable (hf download {name_or_path}) "
                      "or pass a local directory.") from e


def _read_weights(folder: Path) -> dict:
    st = sorted(folder.glob("*.safetensors"))
    if st:
        from safetensors.torch import load_file

        out = {}
        for f in st:
            out.update(load_file(str(f)))
        return out
    bins = sorted(folder.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {folder}")
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out
