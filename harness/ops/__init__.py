"""The operations the architectures in ``harness.models`` run, kept apart from them (as vLLM keeps
``layers/mamba/ops`` apart from its models): an op knows tensors, never a model.

- ``selective_scan``: Mamba's selective scan for the trainer (PyTorch, its Triton kernels, the step-by-step
  reference) and ``choose_scan``, the one place that decides which runs.
- ``scan_triton``: the Triton scan's kernels (forward and backward, the states on chip), checked against the
  PyTorch scan; ``scan_triton_steps``: the same one step at a time, and the side passes that let time run in
  splits; ``scan_tuning``: which of their tiles a launch class takes on a GPU (timed once, remembered).
- ``causal_conv``: the depthwise causal convolution in the projections' layout; ``conv_triton``: its Triton
  kernels, checked against it.
- ``triton_shared``: what those kernels share (a rounding store); ``checked``: the check a fast kernel passes
  on a device before a run uses it.
- ``varlen_attention``: packed rows' causal attention, every sample in one flash call on a GPU.
- ``interpreter``: Triton's CPU interpreter (the tests' GPU stand-in) without the work it repeats (prefix scans
  vectorised, helpers patched once a launch).
- ``kernels``: mamba-ssm's Triton kernels for Phi-Mamba (loaded where they run, fetched for the CPU tests).
"""
