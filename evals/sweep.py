"""One run over several values of a task option: ``--task-arg pairs=16,32,64``.

A task declares an option sweepable with ``metadata={"sweep": True}`` on the option whose value its condition
names (MQAR's ``pairs``, IsTree's ``nodes``, the retrieval tasks' ``length``), so every value is a condition of
its own. ``TaskSweep`` is then the task the engine sees: one sub-task per value behind the Task interface, rows
bundled by sample id so ``--limit N`` keeps N samples of every value."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from evals.base import Instance, OptionError, Task, ToolSpec, make_options


def sweep_field(options_cls: type, values: dict[str, Any]) -> str | None:
    """The option of ``values`` given several values (a comma list or a list); None when nothing is swept.
    More than one swept option, or one not declared sweepable, is an OptionError naming it."""
    swept = []
    hints = typing.get_type_hints(options_cls)
    lists = {name for name, tp in hints.items()  # list options take comma lists themselves (needle's lengths)
             if typing.get_origin(tp) is list or list in map(typing.get_origin, typing.get_args(tp))}
    for key, value in values.items():
        many = (isinstance(value, str) and "," in value) or isinstance(value, (list, tuple))
        if not many or key in lists:
            continue
        field = next((f for f in dataclasses.fields(options_cls) if f.name == key), None)
        if field is None or not field.metadata.get("sweep"):
            sweepable = [f.name for f in dataclasses.fields(options_cls) if f.metadata.get("sweep")]
            raise OptionError(f"--task-arg {key}={value}: {key!r} takes one value"
                              + (f"; sweepable in one run: {', '.join(sweepable)}" if sweepable else ""))
        swept.append(key)
    if len(swept) > 1:
        raise OptionError(f"--task-arg: sweep one option per run, not {' and '.join(swept)}")
    return swept[0] if swept else None


def sweep_values(value) -> list:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)


def checked_options(options_cls: type, values: dict[str, Any], task: str) -> dict[str, Any]:
    """The options as a dict, each swept value checked on its own (the swept option stays a list)."""
    key = sweep_field(options_cls, values)
    if key is None:
        return dataclasses.asdict(make_options(options_cls, values, task))
    checked = [dataclasses.asdict(make_options(options_cls, {**values, key: v}, task))
               for v in sweep_values(values[key])]
    if len({c[key] for c in checked}) < len(checked):
        raise OptionError(f"--task-arg {key}={values[key]}: a value is given twice")
    return {**checked[0], key: [c[key] for c in checked]}


# The plain settings a Task declares at class level (metrics, condition, templates, stops, report axis, ...).
TASK_SETTINGS = tuple(k for k, v in vars(Task).items() if not k.startswith("_") and k not in ("name", "Options")
                      and not callable(v) and not isinstance(v, (classmethod, staticmethod, property)))


class TaskSweep(Task):
    """Sub-tasks of one task class differing in one option, seen by the engine as one task."""

    def __init__(self, cls: type, key: str, data=None, split=None, tokenizer=None, **options):
        self.parts = [cls(data, split, tokenizer=tokenizer, **{**options, key: v}) for v in sweep_values(options[key])]
        self.key, self.data, self.split, self.tokenizer = key, data, split, tokenizer
        first = self.parts[0]
        self.name, self.Options = cls.name, cls.Options
        swept = [getattr(p.options, key) for p in self.parts]
        if len(set(swept)) < len(swept):
            raise OptionError(f"--task-arg {key}={options[key]}: a value is given twice (as {', '.join(map(str, swept))}"
                              "); give each once")
        self.options = dataclasses.replace(first.options, **{key: swept})
        for attr in TASK_SETTINGS:  # every setting a task declares, so a new one needs no edit here
            setattr(self, attr, getattr(first, attr))
        self.default_max_new_tokens = max(p.default_max_new_tokens for p in self.parts)
        self._part_of: dict[str, Task] = {}

    def load(self) -> list[dict]:
        """One row per sample id, holding every value's row of that id."""
        bundles: dict[str, dict] = {}
        for i, part in enumerate(self.parts):
            for row in part.load():
                bundles.setdefault(row["_id"], {"_id": row["_id"], "parts": {}})["parts"][str(i)] = row
        return list(bundles.values())

    def instances(self, rows, *, seed: int, pool_rows=None) -> list[Instance]:
        out = []
        for i, part in enumerate(self.parts):
            mine = [r["parts"][str(i)] for r in rows if str(i) in r["parts"]]
            pool = [r["parts"][str(i)] for r in (pool_rows or rows) if str(i) in r["parts"]]
            for ins in part.instances(mine, seed=seed, pool_rows=pool):
                self._part_of[ins.key] = part
                out.append(ins)
        return out

    def score(self, instance: Instance, generation: str, answer_phrase: str | None = None) -> dict[str, Any]:
        return self._part_of[instance.key].score(instance, generation, answer_phrase)

    def template_vars(self, instance: Instance) -> dict[str, Any]:
        return self._part_of[instance.key].template_vars(instance)

    def make_tool(self, instance: Instance, spec: ToolSpec):
        return self._part_of[instance.key].make_tool(instance, spec)

    def record_fields(self, instance: Instance) -> dict[str, Any]:
        return self._part_of[instance.key].record_fields(instance)

    def evidence(self, instance: Instance) -> list[tuple[str, str]]:
        return self._part_of[instance.key].evidence(instance)

    def write_outputs(self, records, out_dir, conditions) -> list[str]:
        return self.parts[0].write_outputs(records, out_dir, conditions)

    def describe(self, template_variables: set[str] | None = None) -> str:
        return f"{super().describe(template_variables)} (one condition per {self.key})"
