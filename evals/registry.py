"""Task registry: a task name maps to a class; adding a task is one module and one line here."""
from __future__ import annotations


def _tasks():
    from functools import partial

    from evals.hotpotqa import HotpotQA
    from evals.istree import IsTree
    from evals.retrieval_tasks import TASK_NAMES, RetrievalTask

    return {"hotpotqa": HotpotQA, "istree": IsTree, **{n: partial(RetrievalTask, n) for n in TASK_NAMES}}


TASKS = ("hotpotqa", "istree", "index", "ar", "cgram", "counting")


def get_task(name: str, **kwargs):
    tasks = _tasks()
    if name not in tasks:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(tasks))}")
    return tasks[name](**kwargs)
