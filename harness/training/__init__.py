"""The companion trainer: settings and task data (``data``), the training loop (``trainer``), crash-safe run
state (``state``) and grids of runs (``grid``). The command line is ``harness.train``."""
