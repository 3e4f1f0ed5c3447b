"""The machine's own checks and measurements: parity checks (``checks``), the GPU suites (``gpu_suite``,
``quick_suite``) and the prompts they measure with (``fixture_prompts``)."""
