"""Reports across runs: tables and figures (the command line is ``harness.report``), and the plotting set-up
every figure shares (``plotting``)."""
