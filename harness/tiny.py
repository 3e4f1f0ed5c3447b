"""Tiny random-weight models for demos, tests and benchmarks, built offline from configs.

The tokenizer is a real byte-level BPE trained here on the bundled prompts and fixture, so every text
encodes and the same code path as a hub checkpoint (``save_pretrained`` → ``from_pretrained``) is used.

    python -m harness.tiny --arch phi --out runs/tiny-phi
"""
from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import torch

from evals.fixture import FIXTURE_PATH
from harness.models.phi_mamba import PhiMambaConfig, PhiMambaForCausalLM

EOS = "<|endoftext|>"
CORPUS_PATH = Path(__file__).parent / "data" / "tiny_tokenizer_corpus.json"


def _corpus() -> list[str]:
    """Frozen prompt-template text plus the bundled fixture: editing a template never retrains the tiny
    tokenizer (which would change every tiny model's text)."""
    return [*json.loads(CORPUS_PATH.read_text())["texts"], FIXTURE_PATH.read_text()]


def build_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS)
    fast.padding_side = "left"
    return fast


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_tokenizer_from_tiktoken(ranks_file: str | Path):
    """GPT-2's byte-level BPE (Phi-1.5's, less its added whitespace tokens) from a tiktoken ranks file such as
    the ``whisper/assets/gpt2.tiktoken`` that the openai-whisper sdist ships. transformers' TikTokenConverter
    derives the merges; the file is read here (base64 token, rank) so ``tiktoken`` is not needed."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):
            ranks = {}
            for line in Path(path).read_bytes().splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            return ranks

    tok = _Converter(str(ranks_file), pattern=GPT2_PATTERN, extra_special_tokens=[EOS]).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS,
                                   clean_up_tokenization_spaces=False)
    fast.padding_side = "left"
    return fast


def build_config(arch: str, vocab_size: int, max_positions: int = 4096, layers: int = 2, hidden: int = 64,
                 init_std: float = 0.5):
    """``init_std`` is 25x the usual 0.02 so a random model's output depends on its whole prompt; with the
    default, attention is near uniform and every prompt yields the same text, which would let tests of
    padding, caching and batching pass vacuously (at 0.2 the tiny Phi gave 2 distinct generations over 16
    fixture prompts, at 0.5 all 16 differ)."""
    from transformers import LlamaConfig, PhiConfig

    if arch == "phi":
        return PhiConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=max_positions,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=init_std)
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                           initializer_range=init_std)
    families = _family_configs()
    if arch in families:
        return families[arch](vocab_size, hidden, init_std)
    if arch in FLA_ARCHS:
        return _fla_config(arch, vocab_size, hidden, init_std)
    raise ValueError(f"unknown tiny arch {arch!r}; choose phi, llama, phi-mamba, hybrid-phi-mamba or one of "
                     f"{', '.join(FAMILY_ARCHS + FLA_ARCHS)}")


FAMILY_ARCHS = ("gpt2", "mamba", "falcon_mamba", "mamba2", "zamba2", "jamba", "bamba", "falcon_h1", "lfm2",
                "recurrent_gemma", "rwkv")
# flash-linear-attention's families (``pip install "icr-harness[fla]"``; on CPU under TRITON_INTERPRET=1)
FLA_ARCHS = ("gla", "retnet", "delta_net")


def _fla_config(arch: str, vocab_size: int, hidden: int, init_std: float):
    import fla  # noqa: F401  registers its model types with transformers' Auto classes
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=2, num_heads=4,
                                initializer_range=init_std, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                tie_word_embeddings=False, attn_mode="fused_recurrent")


def _family_configs():
    """Tiny configs of the recurrent and hybrid families transformers ships (and two attention baselines), for
    the family matrix test: every layer kind of each family appears at least once."""
    import transformers as T

    def make(cls, **kw):
        return lambda v, h, std: cls(vocab_size=v, hidden_size=h, initializer_range=std, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0, **kw)

    mamba = dict(state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    hybrid = dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    # head sizes scale with the width (16 at hidden 64; 32 at hidden 128, what vLLM's CPU attention takes)
    ssd = lambda h: dict(mamba_d_state=8, mamba_n_heads=8, mamba_d_head=h // 4, mamba_n_groups=1,  # noqa: E731
                         mamba_chunk_size=16)
    return {
        "gpt2": lambda v, h, std: T.GPT2Config(vocab_size=v, n_embd=h, n_layer=2, n_head=4, n_positions=4096,
                                               initializer_range=std, bos_token_id=0, eos_token_id=0),
        "mamba": make(T.MambaConfig, **mamba),
        "falcon_mamba": make(T.FalconMambaConfig, **mamba),
        "mamba2": lambda v, h, std: make(T.Mamba2Config, **mamba, num_heads=8, head_dim=h // 4, n_groups=1,
                                         chunk_size=16)(v, h, std),
        "zamba2": make(T.Zamba2Config, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                       mamba_d_state=8, mamba_headdim=16, mamba_ngroups=1, n_mamba_heads=8, num_attention_heads=4,
                       num_key_value_heads=4, attention_head_dim=16, intermediate_size=128, chunk_size=16),
        "jamba": make(T.JambaConfig, **hybrid, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_expand=2),
        "bamba": lambda v, h, std: make(T.BambaConfig, **hybrid, attn_layer_indices=[1], **ssd(h))(v, h, std),
        "falcon_h1": lambda v, h, std: make(T.FalconH1Config, **hybrid, head_dim=h // 4, mamba_d_ssm=2 * h,
                                            **ssd(h))(v, h, std),
        "lfm2": make(T.Lfm2Config, **hybrid, layer_types=["conv", "full_attention"]),
        "recurrent_gemma": lambda v, h, std: make(
            T.RecurrentGemmaConfig, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, lru_width=h, attention_window_size=64,
            block_types=["recurrent", "recurrent", "attention"])(v, h, std),
        "rwkv": make(T.RwkvConfig, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128,
                     context_length=4096),
    }


def _scale_init(model, std: float) -> None:
    """Same reason as ``build_config``'s ``init_std``: weights large enough that outputs depend on the prompt."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0.0, std)


def make_tiny_model(out: str | Path, arch: str = "phi", seed: int = 0, max_positions: int = 4096,
                    layers: int = 2, hidden: int = 64, tokenizer=None, init_std: float = 0.5,
                    real_heads: bool = False) -> Path:
    """Write a random-weight checkpoint and its tokenizer to ``out`` and return the path. ``real_heads``
    gives a Phi-Mamba family model the released checkpoints' head shapes (32 heads, d_state 64; the hybrid's
    attention at every sixth layer from layer 5), for speed measurements at 1.3B scale."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tok = tokenizer or build_tokenizer()
    torch.manual_seed(seed)
    if arch in ("phi-mamba", "hybrid-phi-mamba"):
        if real_heads:
            cfg = PhiMambaConfig(vocab_size=len(tok), d_model=hidden, n_layer=layers,
                                 max_position_embeddings=max_positions,
                                 attn_layers=list(range(5, layers, 6)) if arch == "hybrid-phi-mamba" else [])
        else:
            cfg = PhiMambaConfig.tiny(vocab_size=len(tok), d_model=hidden, n_layer=layers,
                                      attn_layers=[layers - 1] if arch == "hybrid-phi-mamba" else [])
        model = PhiMambaForCausalLM(cfg)
        _scale_init(model, init_std)
    else:
        model = AutoModelForCausalLM.from_config(build_config(arch, len(tok), max_positions, layers, hidden, init_std))
        if arch in FAMILY_ARCHS + FLA_ARCHS:  # not every family's init reads initializer_range
            _scale_init(model, init_std)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m harness.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="phi", choices=["phi", "llama", "phi-mamba", "hybrid-phi-mamba", *FAMILY_ARCHS, *FLA_ARCHS])
    ap.add_argument("--out", required=True, help="directory to write the checkpoint and tokenizer to")
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(make_tiny_model(a.out, a.arch, a.seed, a.max_positions, a.layers, a.hidden))


if __name__ == "__main__":
    main()
