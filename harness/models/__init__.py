"""Every model implementation the project writes itself, and the name registry.

- ``registry``: short names for the paper's models and the rule for any other hub id or local checkpoint.
- ``phi_mamba``: Phi-Mamba and Hybrid-Phi-Mamba (goombalab's checkpoints), plain PyTorch.
- ``istree``: the trainer's small Transformer / Mamba / hybrid; importing it registers the hybrid's config type
  with transformers' Auto classes (the transformers backend does), so a trained checkpoint loads in any fresh
  process. Not imported here: resolving a model name must not cost transformers' model imports (seconds).
- ``masks``: the attention mask both model files use (a leaf: models never import the decode loop).
"""
from harness.models.registry import (
    MODELS,
    PHI_TOKENIZER,
    TOKENIZER_FILES,
    ModelSpec,
    UnknownModelError,
    resolve_model,
)

__all__ = ["PHI_TOKENIZER", "MODELS", "TOKENIZER_FILES", "ModelSpec", "UnknownModelError", "resolve_model"]
