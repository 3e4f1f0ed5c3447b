"""Model backends. A backend turns prompts into generations; batching, padding and caches live here only.

A new model family is one module defining a ``Backend`` subclass plus its line in ``BACKENDS`` below (the
``--backend`` choices come from it)."""
from __future__ import annotations

from harness.registry import Registry

BACKENDS = Registry("backend", {
    "transformers": "harness.backends.hf:TransformersBackend",
    "phi-mamba": "harness.backends.phi_mamba:PhiMambaBackend",
    "vllm": "harness.backends.vllm_backend:VLLMBackend",
})


def backend_class(name: str) -> type:
    """The ``harness.backends.base.Backend`` subclass registered as ``name``."""
    return BACKENDS.get(name)


GRAPH_MODES = ("auto", "on", "compiled", "off")  # compiled: on, each step compiled (harness.compiled_steps)


def graphs_used(mode: str, backend: type, device) -> bool:
    """Whether a run decodes through CUDA graphs: ``--cuda-graphs on``, or ``auto`` where the backend class can
    (``graph_decode_capable``) and the device is CUDA. One answer for the settings hash and the loaded backend.
    Any other ``mode`` (a bool, a typo) is refused: read as "off", it silently measured eager steps as graphed."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs={mode!r}: give one of {', '.join(GRAPH_MODES)}")
    return mode in ("on", "compiled") or (mode == "auto" and backend.graph_decode_capable
                                          and str(device).startswith("cuda"))


def graphs_compiled(mode: str, backend: type, device) -> bool:
    """Whether the graphed decode step is compiled by inductor first (``--cuda-graphs compiled``)."""
    return mode == "compiled" and graphs_used(mode, backend, device)


__all__ = ["BACKENDS", "GRAPH_MODES", "backend_class", "graphs_compiled", "graphs_used"]

