"""Multiple-choice scoring: each question's context prefilled once for all its choices against every row scored on
its own (``Backend.loglikelihood(share_contexts=False)``), side by side in one run.

    python benchmarks/loglikelihood.py [--questions 8] [--choices 4] [--distractors 4] [--hidden 256 --layers 6]

Contexts are the bundled HotpotQA fixture's 4-shot prompts (long, as a reading-comprehension task's are); the
choices are short answers of 1 to 6 tokens. Random-weight Llama, Mamba (recurrent: no shared path, its rows are
scored alone, so its ratio shows the cost of the check) and Phi-Mamba models of the given size on CPU. Prints
tokens computed, seconds and the speedup, and checks scores and greedy flags agree (within 1e-4)."""
from __future__ import annotations

import tempfile
import time

import torch

from harness.tools.fixture_prompts import fixture_prompts
from harness.backends.loading import load_backend
from harness.tiny import build_tokenizer, make_tiny_model
from harness.tools.bench import benchmark_parser

CHOICES = [" yes", " no", " Paris, France", " the river Olm", " 1887", " a small town in the north"]


def pairs_for(tok, questions: int, choices: int, distractors: int) -> list[tuple[list[int], list[int]]]:
    contexts = fixture_prompts(distractors, questions)[:questions]
    return [(tok(c)["input_ids"], tok(a)["input_ids"]) for c in contexts for a in CHOICES[:choices]]


def timed(backend, pairs, share: bool, batch: int):
    t = time.perf_counter()
    with torch.inference_mode():
        got = backend.loglikelihood(pairs, batch, share_contexts=share)
    return got, time.perf_counter() - t


def main(argv=None) -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--distractors", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = build_tokenizer()
    pairs = pairs_for(tok, a.questions, a.choices, a.distractors)
    contexts = {tuple(c) for c, _ in pairs}
    full_tokens = sum(len(c) + len(x) - 1 for c, x in pairs)
    shared_tokens = sum(map(len, contexts)) + sum(len(x) - 1 for _, x in pairs)
    print(f"{len(pairs)} rows: {len(contexts)} contexts of {min(map(len, contexts))}-{max(map(len, contexts))} "
          f"tokens x {a.choices} choices; tokens computed: {full_tokens} each row alone, {shared_tokens} sharing "
          f"contexts ({full_tokens / shared_tokens:.2f}x fewer)\n")
    print("| model | rows alone (s) | contexts shared (s) | speedup | shared rows | max score diff | same greedy |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for arch in ("llama", "mamba", "phi-mamba"):
            path = make_tiny_model(f"{d}/{arch}", arch, tokenizer=tok, hidden=a.hidden, layers=a.layers,
                                   init_std=0.2)
            backend = load_backend(str(path), "cpu", "float32")
            backend.stats = {}
            timed(backend, pairs[:2], True, a.batch_size)  # warm-up
            backend.stats = {}
            alone, t_alone = timed(backend, pairs, False, a.batch_size)
            shared, t_shared = timed(backend, pairs, True, a.batch_size)
            diff = max(abs(x[0] - y[0]) for x, y in zip(alone, shared))
            same = [x[1] for x in alone] == [y[1] for y in shared] and diff < 1e-4
            print(f"| {arch} | {t_alone:.2f} | {t_shared:.2f} | {t_alone / t_shared:.2f}x | "
                  f"{backend.stats.get('loglikelihood_shared_rows', 0)}/{len(pairs)} | {diff:.1e} | {same} |")


if __name__ == "__main__":
    main()
