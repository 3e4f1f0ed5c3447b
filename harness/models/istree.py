"""The trainer's small models: a Llama-style Transformer, Mamba, and Mamba + one attention layer, all from
transformers' own classes, with the paper's frozen sinusoidal embedding tied to the output head so parameter
counts do not grow with the vocabulary.

Sizes (from the paper's code; the facts: docs/istree.md), trainable parameters in brackets:
    size  Transformer d/FFN/layers/heads   Mamba d/layers        Hybrid d/Mamba layers (+1 Llama layer, 4 heads, FFN 256)
    0.5M  64/256/8/4   (525,376)           64/16  (523,328)      64/13  (490,880)
    1M    64/256/16/4  (1,050,688)         128/9  (1,049,600)    128/7  (980,480)
    2M    128/256/12/4 (1,969,280)         128/18 (2,099,072)    128/14 (1,796,736)
Two entries differ from the paper's table so that every architecture is within 10% of the Transformer, as
the comparison needs: the 0.5M hybrid has 13 Mamba layers (paper: 12, 0.458M, -13%) and the 1M Mamba 9
(paper: 10, 1.17M, +11%).
transformers has no hybrid class that is exactly "Mamba stack, its norm, one Llama decoder layer, head"
(Jamba puts an MLP after every Mamba mixer), so ``HybridForCausalLM`` composes MambaModel and
LlamaDecoderLayer.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutput
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)
from transformers.models.mamba.modeling_mamba import MambaMixer, MambaModel

from harness.ops.causal_conv import causal_conv
from harness.models.masks import block_attention_mask, register_causal_sdpa
from harness.models.packing import current_spans, current_starts
from harness.ops.selective_scan import SCANS, ScanChoice, choose_scan, run_scan

ARCHS = ("transformer", "mamba", "hybrid")
SIZES = {
    # name: transformer (d, ffn, layers, heads), mamba (d, layers), hybrid (d, mamba layers, attention FFN)
    "0.5M": {"transformer": (64, 256, 8, 4), "mamba": (64, 16), "hybrid": (64, 13, 256)},
    "1M": {"transformer": (64, 256, 16, 4), "mamba": (128, 9), "hybrid": (128, 7, 256)},
    "2M": {"transformer": (128, 256, 12, 4), "mamba": (128, 18), "hybrid": (128, 14, 256)},
    # CPU-scale demo size, not from the paper (the hybrid's attention FFN shrinks to stay within 10%)
    "smoke": {"transformer": (32, 128, 2, 4), "mamba": (32, 3), "hybrid": (32, 2, 96)},
}
HYBRID_ATTN_HEADS = 4
RMS_NORM_EPS = 1e-5  # Llama-2's, which the paper's Transformer and hybrid layer copy; mamba-ssm's default too


def sinusoidal_table(vocab: int, d: int) -> torch.Tensor:
    """E[i][2k] = sin(i / 10000^(2k/d)), E[i][2k+1] = cos(i / 10000^(2k/d))."""
    pos = torch.arange(vocab, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    e = torch.zeros(vocab, d)
    e[:, 0::2] = torch.sin(pos * div)
    e[:, 1::2] = torch.cos(pos * div)
    return e


def _mamba_config(vocab, d, layers) -> MambaConfig:
    # mamba-ssm 1.x defaults: d_state 16, expand 2, d_conv 4, dt_rank ceil(d/16); RMSNorm; no linear biases.
    return MambaConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, state_size=16, expand=2,
                       conv_kernel=4, time_step_rank=math.ceil(d / 16), use_bias=False, use_conv_bias=True,
                       layer_norm_epsilon=RMS_NORM_EPS,
                       tie_word_embeddings=True, pad_token_id=4, bos_token_id=11, eos_token_id=4)


class ScanMixer(MambaMixer):
    """transformers' Mamba mixer (same parameters, same checkpoints) whose cache-free pass over whole sequences,
    the trainer's forward and backward and its teacher-forced evaluation, runs the scan ``choose_scan`` picks:
    the parallel ``selective_scan`` (PyTorch or Triton) with ``causal_conv`` in the projections' layout, or,
    under ``auto`` on a GPU where mamba-ssm's fused kernels run, the library's own path. Decoding with a cache
    keeps the library's step. Owned here because transformers takes no argument for its scan; a trained model
    saves and loads as a plain ``MambaForCausalLM``. ``scan`` is the run's choice (``SCANS``, set by
    ``build_model``); ``ran`` keeps what each pass chose (``scans_ran`` reads it back for result.json)."""

    scan = "auto"

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if cache_params is not None:
            return super().forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        b, length, _ = hidden_states.shape
        device = hidden_states.device.type
        # the activations the projections hand the scan and the convolution: autocast's dtype where it is on
        act = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_states.dtype
        starts = current_starts()  # packed rows: the state restarts at each sample's first token
        choice = choose_scan((b, self.intermediate_size, length), hidden_states.device, act,
                             self.ssm_state_size, self.scan,
                             fused=self.scan == "auto" and starts is None and mamba_kernels_run(hidden_states),
                             resets=starts is not None)
        self.__dict__.setdefault("ran", {})[choice] = None  # not a module attribute: state_dict and copies skip it
        if choice.scan == "mamba-ssm":
            return super().forward(hidden_states, cache_params=None, attention_mask=attention_mask, **kwargs)
        # Tensors stay [batch, time, channels] in memory (the scan takes transposed views): the projections read
        # them without copies, and the scan's own layout changes run along contiguous channels.
        x, gate = self.in_proj(_masked(hidden_states, attention_mask)).chunk(2, dim=-1)
        x = _masked(self.act(causal_conv(x, self.conv1d.weight, self.conv1d.bias, choice.conv, starts)), attention_mask)
        dt, B, C = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size],
                               dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)  # the bias is added in the scan, with the softplus
        y = run_scan(choice, x.transpose(1, 2), dt.transpose(1, 2), -torch.exp(self.A_log.float()),
                     B.transpose(1, 2), C.transpose(1, 2), D=self.D.float(), z=gate.transpose(1, 2),
                     delta_bias=self.dt_proj.bias.float(), delta_softplus=True, starts=starts)
        return self.out_proj(y.transpose(1, 2).to(hidden_states.dtype))


def scans_ran(model: torch.nn.Module, forget: bool = False) -> list[dict]:
    """Which scans ``model``'s Mamba mixers ran, on what and in which precision (each once, in the order first
    run): the trainer's result.json. ``forget``: start a new record after reading."""
    seen: dict[ScanChoice, None] = {}
    for module in model.modules():
        if isinstance(module, ScanMixer):
            seen.update(module.__dict__.get("ran", {}))
            if forget:
                module.__dict__["ran"] = {}
    return [c.to_json() for c in seen]


def _masked(hidden_states, attention_mask):
    """Padding positions zeroed, as transformers' mixer does before its projections and its scan."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def own_scan_(backbone: MambaModel, scan: str = "auto") -> None:
    """Every mixer of a ``MambaModel`` made a ``ScanMixer`` running ``scan``, weights kept (and the random stream
    untouched, so a seed builds the same model as before)."""
    if scan not in SCANS:
        raise ValueError(f"scan={scan!r}: use {', '.join(SCANS)}")
    for block in backbone.layers:
        with torch.random.fork_rng(devices=[]):
            mixer = ScanMixer(block.mixer.config, layer_idx=block.mixer.layer_idx)
        mixer.scan = scan
        mixer.load_state_dict(block.mixer.state_dict())
        block.mixer = mixer.to(next(block.mixer.parameters()).device)


def mamba_kernels_run(t: torch.Tensor) -> bool:
    """Whether transformers' Mamba mixer would run mamba-ssm's fused CUDA kernels on this tensor."""
    return t.is_cuda and _mamba_ssm_imports()


@functools.lru_cache(maxsize=None)
def _mamba_ssm_imports() -> bool:
    """Asked once a process: a failed import is not cached by Python, and the mixer asks on every pass."""
    try:
        import mamba_ssm  # noqa: F401  lazy: mamba-ssm is an optional GPU extra
    except ImportError:
        return False
    return True


class HybridConfig(PretrainedConfig):
    model_type = "icr_hybrid"

    def __init__(self, vocab_size=64, hidden_size=64, mamba_layers=12, attn_heads=4, attn_ffn=256,
                 max_position_embeddings=8192, **kwargs):
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size, self.mamba_layers = vocab_size, hidden_size, mamba_layers
        self.attn_heads, self.attn_ffn, self.max_position_embeddings = attn_heads, attn_ffn, max_position_embeddings

    def mamba(self) -> MambaConfig:
        return _mamba_config(self.vocab_size, self.hidden_size, self.mamba_layers)

    def llama(self) -> LlamaConfig:
        cfg = LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.attn_ffn,
                          num_hidden_layers=1, num_attention_heads=self.attn_heads, num_key_value_heads=self.attn_heads,
                          max_position_embeddings=self.max_position_embeddings, rms_norm_eps=RMS_NORM_EPS,
                          attn_implementation=register_causal_sdpa())  # SDPA; packed rows: each sample alone
        return cfg


class HybridForCausalLM(PreTrainedModel):
    """Mamba stack (with its final norm) → one Llama decoder layer → tied head. ``cache_params`` is a pair
    (Mamba cache, KV cache of the attention layer)."""

    config_class = HybridConfig
    base_model_prefix = "backbone"
    _no_split_modules = ["MambaBlock", "LlamaDecoderLayer"]

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.backbone = MambaModel(config.mamba())
        llama = config.llama()
        self.attn = LlamaDecoderLayer(llama, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embeddings

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache_params=None, use_cache=False,
                logits_to_keep: int = 0, **kwargs):
        from transformers import DynamicCache

        b, l = input_ids.shape
        mcache, kv = cache_params if cache_params is not None else (None, None)
        if use_cache and kv is None:
            kv = DynamicCache()
        past = kv.get_seq_length() if kv is not None else 0
        starts = current_starts() if past == 0 else None
        # no mask, no cache, not packed (the trainer's padded rows: padding only after each sample, never a
        # target): SDPA's causal kernels, not a dense [b, 1, l, l] mask that keeps flash attention off; packed
        # rows with their spans known: each sample's own causal attention (``masks.per_sample_attention``)
        causal_only = attention_mask is None and past == 0 and (starts is None or current_spans() is not None)
        if attention_mask is None:
            attention_mask = torch.ones(b, past + l, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -l:]
        out = self.backbone(input_ids, attention_mask=attention_mask if l > 1 else None, cache_params=mcache,
                            use_cache=use_cache)
        h = out.last_hidden_state
        mask = None if causal_only else block_attention_mask(attention_mask, l, starts)
        h = self.attn(h, attention_mask=mask, position_ids=position_ids, past_key_values=kv,
                      position_embeddings=self.rotary(h, position_ids), use_cache=use_cache)
        h = h[0] if isinstance(h, tuple) else h
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = h @ self.backbone.embeddings.weight.T
        result = CausalLMOutput(logits=logits)
        result.cache_params = (out.cache_params, kv) if use_cache else None
        return result


AutoConfig.register("icr_hybrid", HybridConfig)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM)


def build_model(arch: str, size: str, vocab: int, max_positions: int = 8192, d_model: int | None = None,
                layers: int | None = None, scan: str = "auto") -> PreTrainedModel:
    """A fresh model of the size table's shape (``d_model`` / ``layers`` override its width and depth; for the
    hybrid, ``layers`` counts Mamba layers), initialised as the paper's code initialises it; its Mamba layers
    run ``scan`` (``selective_scan.SCANS``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; choose {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown --size {size!r}; choose {', '.join(SIZES)}")
    spec = list(SIZES[size][arch])
    if d_model is not None:
        if d_model < 8 or d_model % 8:
            raise ValueError(f"--d-model {d_model}: use a multiple of 8 (4 attention heads of even width)")
        spec[0] = d_model
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers}: use 1 or more")
        spec[2 if arch == "transformer" else 1] = layers
    if arch == "transformer":
        d, ffn, n_layers, heads = spec
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn,
                                             num_hidden_layers=n_layers, num_attention_heads=heads,
                                             num_key_value_heads=heads, max_position_embeddings=max_positions,
                                             rms_norm_eps=RMS_NORM_EPS, tie_word_embeddings=True, pad_token_id=4,
                                             bos_token_id=11, eos_token_id=4,
                                             attn_implementation=register_causal_sdpa()))
    elif arch == "mamba":
        model = MambaForCausalLM(_mamba_config(vocab, *spec))
        mamba_ssm_init_(model.backbone)
        own_scan_(model.backbone, scan)
    else:
        d, n_layers, ffn = spec
        model = HybridForCausalLM(HybridConfig(vocab_size=vocab, hidden_size=d, mamba_layers=n_layers,
                                               attn_heads=HYBRID_ATTN_HEADS, attn_ffn=ffn,
                                               max_position_embeddings=max_positions))
        mamba_ssm_init_(model.backbone)
        own_scan_(model.backbone, scan)
        torch_default_init_(model.attn)
    freeze_sinusoidal_embedding(model)
    return model


@torch.no_grad()
def mamba_ssm_init_(backbone: nn.Module) -> None:
    """Re-initialise a transformers ``MambaModel`` as mamba-ssm initialises ``MambaLMHeadModel`` (the paper's
    Mamba): PyTorch's default init for ``in_proj``, ``x_proj`` and ``conv1d`` (bias included), ``out_proj``
    PyTorch-default then divided by sqrt(n_layer) (the GPT-2 residual rule, one residual per Mamba block),
    dt_proj weight U(+-dt_rank^-0.5) and its bias the inverse softplus of dt ~ logU(1e-3, 0.1) floored at 1e-4,
    A_log = log(1..d_state), D = 1, norms 1. transformers instead draws every linear from N(0, 0.1), zeroes the
    conv bias and leaves out_proj unscaled. Written by hand: no library exposes mamba-ssm's rule for these modules."""
    layers = backbone.layers
    for block in layers:
        mixer = block.mixer
        for lin in (mixer.in_proj, mixer.x_proj, mixer.conv1d):
            lin.reset_parameters()
        mixer.out_proj.reset_parameters()
        mixer.out_proj.weight /= math.sqrt(len(layers))
        rank = mixer.dt_proj.in_features
        nn.init.uniform_(mixer.dt_proj.weight, -rank ** -0.5, rank ** -0.5)
        dt = torch.exp(torch.rand(mixer.dt_proj.out_features) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        mixer.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        state = mixer.A_log.shape[1]
        mixer.A_log.copy_(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).expand_as(mixer.A_log))
        mixer.D.fill_(1.0)
        for lin in (mixer.in_proj, mixer.x_proj, mixer.out_proj):
            if lin.bias is not None:
                lin.bias.zero_()
    for module in backbone.modules():
        if "RMSNorm" in type(module).__name__:
            module.weight.fill_(1.0)


@torch.no_grad()
def torch_default_init_(module: nn.Module) -> None:
    """PyTorch's own initialisation for every linear layer under ``module``: the paper's hybrid builds its
    Llama layer after mamba-ssm's init pass, so that layer keeps torch's defaults (not N(0, 0.02))."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()


def freeze_sinusoidal_embedding(model: PreTrainedModel) -> None:
    emb = model.get_input_embeddings()
    with torch.no_grad():
        emb.weight.copy_(sinusoidal_table(*emb.weight.shape))
    emb.weight.requires_grad_(False)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head.weight is not emb.weight:
        raise RuntimeError("the output head must be tied to the frozen embedding")


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
