"""The evaluation engine: a run's settings (``config``), prompts (``prompting``), the run itself (``run``: task →
instances → prompts → backend → scores), its directory (``runlog``: lock, resume log), what identifies it
(``identity``, ``hub``), and what it reports (``stats``, ``results``, ``audit``).

``run_eval`` and ``load_backend`` are imported on first use: the light modules here (config, stats) must not
cost torch's import."""


def __getattr__(name):
    if name in ("run_eval", "load_backend", "EvalRun"):
        from harness.engine import run

        return getattr(run, name)
    raise AttributeError(f"module 'harness.engine' has no attribute {name!r}")


__all__ = ["run_eval", "load_backend", "EvalRun"]
