"""The one registry mechanism behind tasks, backends and model names.

An entry is a name and either a value or a lazy ``"module:object"`` string, imported on first use, so listing
the names (the CLI's choices and help) never imports what they name. Entries come from a table at the
registry's definition, from ``@registry.register(name)`` on a class, or from modules a registry discovers
(every module of a package, imported once when a name is first looked up)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Iterator


class Registry:
    def __init__(self, kind: str, entries: dict[str, Any] | None = None, discover: str | None = None):
        self.kind = kind
        self._entries: dict[str, Any] = dict(entries or {})
        self._discover = discover

    def register(self, name: str) -> Callable:
        """A decorator: ``@TASKS.register("mqar")`` on a class adds it under ``name`` (and sets its ``name``)."""
        def add(obj):
            self.add(name, obj)
            if isinstance(obj, type):
                obj.name = name
            return obj
        return add

    def add(self, name: str, target: Any) -> None:
        """``target``: the object, or ``"module:object"`` to import on first use."""
        have = self._entries.get(name)
        if have is not None and have is not target:
            raise ValueError(f"{self.kind} name {name!r} is registered twice ({_where(have)}, {_where(target)})")
        self._entries[name] = target

    def get(self, name: str) -> Any:
        self._load_all()
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        target = self._entries[name]
        if isinstance(target, str) and ":" in target:
            module, obj = target.split(":")
            target = self._entries[name] = getattr(importlib.import_module(module), obj)
        return target

    def names(self) -> list[str]:
        self._load_all()
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load_all()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _load_all(self) -> None:
        if self._discover is None:
            return
        package, self._discover = importlib.import_module(self._discover), None
        for mod in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{mod.name}")


def _where(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__module__", repr(target))
