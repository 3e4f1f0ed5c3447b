"""A model's tokenizer as every backend uses it: loaded through transformers' ``AutoTokenizer`` (the HF cache
only when the hub is out of reach), padded on the left, with a pad and an eos token. Apart from the backends so
that the engine reads a tokenizer (a task builds its prompts with it) without loading any model code."""
from __future__ import annotations

from harness import hub


class TokenizerError(ValueError):
    """A tokenizer the engine cannot batch or stop with; the message names it and the fix."""


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # lazy: start-up time (an error before any tokenizer loads is quick)

    tok = AutoTokenizer.from_pretrained(path, **hub.load_kwargs(path))
    return prepare_tokenizer(tok, path)


def prepare_tokenizer(tok, source: str):
    """Left padding, and a pad token (the eos token when it has none): batched prompts need one, and a tokenizer
    with neither cannot say where a generation ends or how a row is padded."""
    tok.padding_side = "left"
    if tok.eos_token_id is None:
        raise TokenizerError(f"tokenizer {source} has no eos token, so no generation could end before its token "
                             "limit and no batch could be padded; set \"eos_token\" in its tokenizer_config.json (or "
                             "pass --tokenizer with a complete one)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
