"""The evaluation engine: a run's settings (``config``), prompts (``prompting``), the run itself (``run``: task →
instances → prompts → backend → scores), its directory (``runlog``: lock, resume log), what identifies it
(``identity``, ``hub``), and what it reports (``stats``, ``results``, ``audit``).

``run_eval`` and ``EvalRun`` are imported on first use (lazy for start-up time: the modules a report reads runs
through, config, runlog and stats, do not load transformers' model code). Backends are loaded by
``harness.backends.loading``."""


def __getattr__(name):
    if name in ("run_eval", "EvalRun"):
        from harness.engine import (
            run,  # lazy: start-up time (reading runs loads no model code)
        )

        return getattr(run, name)
    raise AttributeError(f"module 'harness.engine' has no attribute {name!r}")


__all__ = ["run_eval", "EvalRun"]
