"""Task registry: ``@register_task("name")`` on a Task subclass is all it takes to add a task.

Every module of the ``evals`` package is imported on first use, so a new task is one module (plus its template
and tests): the CLI's ``--task`` choices, its help and ``--task-arg`` validation all derive from here."""
from __future__ import annotations

import importlib
import pkgutil

TASKS: dict[str, type] = {}
_LOADED = False


def register_task(name: str):
    def add(cls):
        if name in TASKS and TASKS[name] is not cls:
            raise ValueError(f"task name {name!r} is registered twice ({TASKS[name].__module__}, {cls.__module__})")
        cls.name = name
        TASKS[name] = cls
        return cls
    return add


def _load_all() -> None:
    global _LOADED
    if not _LOADED:
        import evals

        for mod in pkgutil.iter_modules(evals.__path__):
            importlib.import_module(f"evals.{mod.name}")
        _LOADED = True


def task_class(name: str) -> type:
    _load_all()
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def task_names() -> list[str]:
    _load_all()
    return sorted(TASKS)


def get_task(name: str, **kwargs):
    """``kwargs``: ``data``, ``split`` and the task's own options (fields of its ``Options``). Several values of
    a sweepable option (``pairs="16,32"`` or ``[16, 32]``) give one task over all of them (evals.sweep)."""
    from evals.sweep import TaskSweep, sweep_field

    cls = task_class(name)
    options = {k: v for k, v in kwargs.items() if k not in ("data", "split")}
    key = sweep_field(cls.Options, options)
    if key is not None:
        return TaskSweep(cls, key, **kwargs)
    return cls(**kwargs)
