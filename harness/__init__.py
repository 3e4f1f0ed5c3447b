"""icr-harness: evaluation engine, model backends, CLI and reports for in-context retrieval studies."""
__version__ = "0.3.0"
