"""Task definitions: data loading, instance construction and scoring. Tasks know data, never models."""
from evals.registry import get_task, register_task, task_class, task_names

__all__ = ["get_task", "register_task", "task_class", "task_names"]
