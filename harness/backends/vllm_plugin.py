"""The project's vLLM plugin: Phi-Mamba and Hybrid-Phi-Mamba checkpoints in any vLLM process.

Installed with the project as a ``vllm.general_plugins`` entry point (pyproject.toml), so vLLM calls ``register``
in every process it starts (the server, its engine core, its workers) with nothing imported by the user:

    vllm serve goombalab/Phi-Mamba --config-format phi-mamba --tokenizer microsoft/phi-1_5 --dtype float32
    vllm.LLM(model="goombalab/Hybrid-Phi-Mamba", config_format="phi-mamba", tokenizer="microsoft/phi-1_5")

goombalab's config.json (LanguageModel / MixerModel / BlockN) names no model type, so it is read through the config
format ``phi-mamba`` registered here (vLLM's ``register_config_parser``); a checkpoint whose config.json says
``"model_type": "phi_mamba"`` needs no flag. The models themselves: ``harness.backends.vllm_phi_mamba``."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import PretrainedConfig

from harness.models.phi_mamba import PhiMambaConfig

CONFIG_FORMAT = "phi-mamba"
MODEL_TYPE = "phi_mamba"
ARCHITECTURES = {False: "PhiMambaForCausalLM", True: "HybridPhiMambaForCausalLM"}  # by: has attention layers
MODULE = "harness.backends.vllm_phi_mamba"
GOOMBALAB_KEYS = ("LanguageModel", "MixerModel", "icr_harness")  # and Block1..BlockN


class PhiMambaVLLMConfig(PretrainedConfig):
    """What vLLM reads of a model (vocabulary, width, layers, heads, context, Mamba chunk size), and the reference
    model's own config in ``phi_mamba`` (the fields of ``harness.models.phi_mamba.PhiMambaConfig``)."""

    model_type = MODEL_TYPE

    def __init__(self, phi_mamba: dict | None = None, **kwargs):
        goombalab = {k: kwargs.pop(k) for k in list(kwargs) if k in GOOMBALAB_KEYS or k.startswith("Block")}
        if phi_mamba is None and goombalab:  # a goombalab-format config.json read as this model type
            phi_mamba = reference_fields(PhiMambaConfig.from_goombalab(goombalab))
        self.phi_mamba = dict(phi_mamba or {})
        if self.phi_mamba:
            cfg = PhiMambaConfig(**self.phi_mamba)
            heads = cfg.num_attention_heads
            kwargs.setdefault("architectures", [ARCHITECTURES[bool(cfg.attn_layers)]])
            derived = {"vocab_size": cfg.padded_vocab, "hidden_size": cfg.d_model,
                       "num_hidden_layers": cfg.n_layer, "num_attention_heads": heads,
                       "num_key_value_heads": heads, "head_dim": cfg.d_model // heads, "chunk_size": cfg.chunk_size,
                       "layer_norm_eps": cfg.layer_norm_eps, "tie_word_embeddings": False}
            if cfg.attn_layers:  # a pure Mamba stack has no position limit (vLLM's --max-model-len sets one)
                derived["max_position_embeddings"] = cfg.max_position_embeddings
            for k, v in derived.items():
                kwargs.setdefault(k, v)
        super().__init__(**kwargs)


def reference_fields(cfg: PhiMambaConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.compare}


def config_from_goombalab(raw: dict) -> PhiMambaVLLMConfig:
    """vLLM's config for a goombalab-format config.json (raises ValueError naming what it cannot map)."""
    return PhiMambaVLLMConfig(phi_mamba=reference_fields(PhiMambaConfig.from_goombalab(raw)), torch_dtype="float32")


def _read_config(model: str | Path, revision: str | None) -> dict:
    """config.json of a local folder or a hub repository (through the HF cache, as vLLM reads any config)."""
    config_dict, _ = PretrainedConfig.get_config_dict(str(model), revision=revision)
    return config_dict


def register() -> None:
    """vLLM's plugin hook: the config format and both architectures. Safe to call more than once."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig
    from vllm.transformers_utils.config import get_config_parser, register_config_parser
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    class PhiMambaConfigParser(ConfigParserBase):
        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            raw = _read_config(model, revision)
            return raw, config_from_goombalab(raw)

    try:
        get_config_parser(CONFIG_FORMAT)
    except ValueError:  # not registered yet in this process
        register_config_parser(CONFIG_FORMAT)(PhiMambaConfigParser)
    AutoConfig.register(MODEL_TYPE, PhiMambaVLLMConfig, exist_ok=True)
    for arch in ARCHITECTURES.values():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"{MODULE}:{arch}")
    # vLLM sizes a pure Mamba model's state blocks (and turns its prefix caching into the Mamba form) through a
    # per-architecture hook; it has no public way to name one, so the plugin adds its entry as vLLM's own models
    # do. The hybrid is handled by vLLM's hybrid hook, which every IsHybrid model gets.
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURES[False], MambaModelConfig)
