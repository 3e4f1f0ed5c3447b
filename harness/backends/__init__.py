"""Model backends. A backend turns prompts into generations; batching, padding and caches live here only.

A new model family is one module defining a ``Backend`` subclass plus a line in ``BACKENDS``."""
from __future__ import annotations

import importlib

from harness.backends.base import Backend

BACKENDS = {
    "transformers": "harness.backends.hf:TransformersBackend",
    "phi-mamba": "harness.backends.phi_mamba:PhiMambaBackend",
    "vllm": "harness.backends.vllm_backend:VLLMBackend",
}


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["Backend", "BACKENDS", "backend_class"]
