"""Cost of searches that time out: the searches of one decoding step side by side vs one after another.

    python benchmarks/tool_timeouts.py [--rows 8] [--timeout 1.0]

Every row's pattern backtracks catastrophically, so each search is cut by ``--tool-timeout``. The generation
loop issues a step's searches at once (``harness.backends.generation``, checked by tests/test_run_integrity.py) and the
searcher runs concurrent searches in worker processes of their own, so the step costs about one timeout; run
one after another it would cost ``rows`` of them. Both give every row a ``[timeout]``
result (checked); the printed ratio is wall time sequential / side by side, measured in one run. Timing lives
here, not in the tests: a loaded machine stretches wall time."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from retrieval import RetrievalTool
from retrieval.search import RegexSearcher
from harness.tools.bench import benchmark_parser

CALL = "<search>(a+)+$</search>"
UNITS = ["a" * 64 + "!"]


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1.0)
    a = ap.parse_args()
    searcher = RegexSearcher(timeout=a.timeout)
    searcher.search("a", ["a"])  # a warm worker, as in a running evaluation

    def step(parallel: bool) -> tuple[float, list[str]]:
        tools = [RetrievalTool(UNITS, searcher=searcher) for _ in range(a.rows)]
        t0 = time.perf_counter()
        if parallel:
            with ThreadPoolExecutor(a.rows) as pool:
                out = list(pool.map(lambda t: t(CALL), tools))
        else:
            out = [t(CALL) for t in tools]
        return time.perf_counter() - t0, out

    side, side_out = step(parallel=True)
    seq, seq_out = step(parallel=False)
    same = side_out == seq_out == ["<result>[timeout]</result>"] * a.rows
    print(f"{a.rows} searches timing out after {a.timeout:g} s each:")
    print(f"  side by side   {side:6.2f} s")
    print(f"  one by one     {seq:6.2f} s   ({seq / side:.1f}x the side-by-side wall time)")
    print(f"  every row got [timeout]: {same}")
    searcher.close()


if __name__ == "__main__":
    main()
