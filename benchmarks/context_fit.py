"""How many HotpotQA prompts fit a model's context, by number of distractors: the bundled fixture's paragraphs
follow real HotpotQA lengths (about 110 GPT-2 tokens each), so its prompt lengths and skips carry over.

    python benchmarks/context_fit.py [--tokenizer DIR] [--context 2048] [--max-new-tokens 96]

Prompts are rendered by the task and template a run uses (4-shot CoT; first/middle/last gold positions) and
tokenized with ``--tokenizer`` (default: GPT-2's real BPE, Phi-1.5's on prose, where the test suite has cached it
under ~/.cache/icr-harness/gpt2-bpe; else the tiny test tokenizer, which says so). A prompt fits when it and
the generation budget fit the context, as the engine decides before it skips a prompt as too long."""
from __future__ import annotations

import statistics

from evals import get_task
from harness.tools.fixture_prompts import fixture_prompts
from harness.cache import cache_dir
from harness.tools.bench import benchmark_parser

GPT2 = cache_dir() / "gpt2-bpe"


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--context", type=int, default=2048, help="Phi-1.5's")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--distractors", default="0,1,2,3,4,5,6,7,8,9,10")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    if a.tokenizer or GPT2.is_dir():
        tok, name = AutoTokenizer.from_pretrained(a.tokenizer or GPT2), a.tokenizer or "GPT-2 BPE"
    else:
        from harness.tiny import build_tokenizer

        tok, name = build_tokenizer(), "the tiny test tokenizer (GPT-2's BPE is not cached here)"
    paragraphs = [len(tok("".join(s))["input_ids"]) for r in get_task("hotpotqa", data="fixture").load()
                  for _, s in r["context"]]
    print(f"tokenizer: {name}; fixture paragraphs: {statistics.mean(paragraphs):.0f} tokens on average "
          f"({min(paragraphs)}-{max(paragraphs)})\n")
    print(f"| distractors | prompt tokens (mean / max) | fit {a.context} with {a.max_new_tokens} new |")
    print("|---|---|---|")
    for k in map(int, a.distractors.split(",")):
        lengths = [len(tok(p)["input_ids"]) for p in fixture_prompts(k)]
        fit = sum(n + a.max_new_tokens <= a.context for n in lengths)
        print(f"| {k} | {statistics.mean(lengths):.0f} / {max(lengths)} | {fit} of {len(lengths)} |")


if __name__ == "__main__":
    main()
