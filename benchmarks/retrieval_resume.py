"""Cost of the tool loop: resuming from the cache after each tool call vs re-prefilling the whole prompt.

    python benchmarks/retrieval_resume.py [--context 2000] [--calls 3] [--hidden 256 --layers 4]

Builds a random-weight Phi (the path real checkpoints take), a ~2,000-token prompt from the bundled fixture,
and a tool whose call tags are taken from text the model writes, so calls happen. Both strategies produce the
same tokens (checked); the printed ratio is wall time re-prefill / cache resume, measured in one run."""
from __future__ import annotations

import tempfile
import time

import torch

from evals.fixture import FIXTURE_PATH
from harness.backends.base import GenRequest
from harness.backends.loading import load_backend
from harness.tiny import make_tiny_model
from retrieval import RetrievalTool
from harness.tools.bench import benchmark_parser


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        backend = load_backend(str(make_tiny_model(d, "phi", hidden=a.hidden, layers=a.layers)), "cpu", "float32")
    tok = backend.tokenizer
    text = FIXTURE_PATH.read_text()
    units = [l.strip() for l in text.splitlines() if len(l.strip()) > 20][:200]
    prompts = []
    for i in range(a.samples):
        ids = tok(text[i * 997:])["input_ids"][: a.context]
        prompts.append(ids)
    free = [backend.generate([GenRequest("", a.new_tokens, prompt_ids=p)])[0].text for p in prompts]
    tags = [(f[0:2], f[6:9]) for f in free]

    def tool(i):
        return RetrievalTool(units, max_calls=a.calls, call_open=tags[i][0], call_close=tags[i][1])

    # cache resume: the engine's path
    t0 = time.perf_counter()
    cached = [backend.generate([GenRequest("", a.new_tokens, tool=tool(i), prompt_ids=p)])[0]
              for i, p in enumerate(prompts)]
    t_cached = time.perf_counter() - t0

    # re-prefill: stop at each call, append the result, start a fresh generation over everything
    t0 = time.perf_counter()
    reprefill, prefill_tokens = [], 0
    for i, p in enumerate(prompts):
        t, ids, budget = tool(i), [], a.new_tokens
        while True:
            can_call = len(t.log) < t.max_calls
            r = backend.generate([GenRequest("", budget, stop=[t.call_end] if can_call else [],
                                             prompt_ids=p + ids)])[0]
            prefill_tokens += len(p) + len(ids)
            budget -= r.new_tokens
            if r.finish_reason != "stop" or budget <= 0:
                ids += r.token_ids
                break
            # the protocol: the model's text up to the end of the closing tag (a last token that runs past
            # it is re-tokenized), then the result
            call = r.text + t.call_end
            before = tok.decode(r.token_ids[:-1])
            round_ids = r.token_ids if tok.decode(r.token_ids) == call else \
                r.token_ids[:-1] + tok(call[len(before):], add_special_tokens=False)["input_ids"]
            ids += round_ids + tok(t(call), add_special_tokens=False)["input_ids"]
        reprefill.append(ids)
    t_re = time.perf_counter() - t0

    same = all(c.token_ids == r for c, r in zip(cached, reprefill))
    calls = sum(len(c.tool_spans) for c in cached)
    print(f"model: random Phi d={a.hidden} L={a.layers}, context {a.context} tokens, {a.samples} samples, "
          f"{calls} tool calls in all, {a.new_tokens} new tokens each")
    print(f"cache resume : {t_cached:8.3f} s  (prefill tokens {sum(len(p) for p in prompts)})")
    print(f"re-prefill   : {t_re:8.3f} s  (prefill tokens {prefill_tokens})")
    print(f"ratio re-prefill / cache resume: {t_re / t_cached:.2f}x   identical tokens: {same}")


if __name__ == "__main__":
    main()
