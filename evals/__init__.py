"""Task definitions: data loading, instance construction and scoring. Tasks know data, never models."""
from evals.registry import TASKS, get_task

__all__ = ["TASKS", "get_task"]
