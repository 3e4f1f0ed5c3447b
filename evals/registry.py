"""Task registry: a task name maps to a class; adding a task is one module and one line here."""
from __future__ import annotations


def _tasks():
    from evals.hotpotqa import HotpotQA
    from evals.istree import IsTree

    return {"hotpotqa": HotpotQA, "istree": IsTree}


TASKS = ("hotpotqa", "istree")


def get_task(name: str, **kwargs):
    tasks = _tasks()
    if name not in tasks:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(tasks))}")
    return tasks[name](**kwargs)
