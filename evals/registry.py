"""The task registry: ``@register_task("name")`` on a Task subclass is all it takes to add a task.

Every module of the ``evals`` package is imported on first use, so a new task is one module (plus its template
and tests): the CLI's ``--task`` choices, its help and ``--task-arg`` validation all derive from here."""
from __future__ import annotations

from evals.sweep import TaskSweep, sweep_field
from harness.registry import Registry

TASKS = Registry("task", discover="evals")


def register_task(name: str):
    return TASKS.register(name)


def task_class(name: str) -> type:
    return TASKS.get(name)


def task_names() -> list[str]:
    return sorted(TASKS.names())


def get_task(name: str, **kwargs):
    """``kwargs``: ``data``, ``split`` and the task's own options (fields of its ``Options``). Several values of
    a sweepable option (``pairs="16,32"`` or ``[16, 32]``) give one task over all of them (evals.sweep)."""
    cls = task_class(name)
    options = {k: v for k, v in kwargs.items() if k not in ("data", "split", "tokenizer")}
    key = sweep_field(cls.Options, options)
    if key is not None:
        return TaskSweep(cls, key, **kwargs)
    return cls(**kwargs)
