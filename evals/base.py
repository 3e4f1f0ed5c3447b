"""What every task provides to the engine: instances to prompt, and a scorer for what came back."""
from __future__ import annotations

import dataclasses
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from retrieval import tool


class DataError(ValueError):
    """A dataset is missing or a row is malformed; the message names the row, the field and the fix."""


def read_utf8(path, what: str = "data file", error=DataError) -> str:
    """A text file's content; a file that is not UTF-8 is an ``error`` naming the file, line and byte."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise error(f"{what} {path} is not UTF-8 text: byte {e.start} (line {line}) is 0x{raw[e.start]:02x}; "
                    "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


class OptionError(ValueError):
    """A task option (``--task-arg KEY=VALUE`` or a task's own flag) cannot work; the message names it."""


KEY_SEPARATOR = "@"  # never in an id (the engine refuses such data), so a key splits at its first one


def instance_key(id: str, condition: str) -> str:
    """A sample's key in samples.jsonl: its id and its condition (a condition may itself hold the separator,
    as the needle's ``length@depth`` does; an id may not)."""
    return f"{id}{KEY_SEPARATOR}{condition}"


@dataclass
class Instance:
    """One prompt to run, as the engine sees it: an id, the condition the task groups results by (HotpotQA: the
    gold paragraphs' position; synthetic tasks: a size or a length) and the gold answer. What the prompt is made
    of is the task's: a subclass adds its fields and says what its template reads (``template_vars``)."""

    id: str
    condition: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return instance_key(self.id, self.condition)

    def template_vars(self) -> dict[str, Any]:
        return {"meta": self.meta}


@dataclass
class TextInstance(Instance):
    """A prompt that is one text: a symbol sequence, a phone book, a serialized graph. The bundled templates
    read it as ``question`` (the name every template of the project gives the test input)."""

    text: str = ""

    def template_vars(self) -> dict[str, Any]:
        return {"question": self.text, "meta": self.meta}


@dataclass(frozen=True)
class ToolSpec:
    """The retrieval tool as the flags set it. Templates get its syntax as the variable ``tool`` (so no
    template retypes a tag), and every task's tool obeys its limits."""

    enabled: bool = False
    max_calls: int = 4
    timeout: float = 1.0
    max_chars: int = 300

    def template_vars(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "call_open": tool.CALL_OPEN, "call_close": tool.CALL_CLOSE,
                "result_open": tool.RESULT_OPEN, "result_close": tool.RESULT_CLOSE, "no_match": tool.NO_MATCH,
                "separator": tool.SEPARATOR, "max_calls": self.max_calls}


@dataclass
class NoOptions:
    """A task without options of its own."""


class Task(ABC):
    """What the engine asks of a task. Subclass it, declare ``Options`` (a dataclass whose fields, with
    ``metadata={"help": ...}``, are the task's ``--task-arg`` options; ``"flag": True`` also gives one its own
    ``--NAME`` flag, ``"sweep": True`` lets a comma list sweep it) and decorate with ``@register_task``.

    Everything else has a default: no tool, template variables from the instance, no extra output files."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    metrics: ClassVar[tuple[str, ...]] = ("accuracy",)
    # The metrics that are 0 or 1 on every row: paired differences of these get McNemar's exact test, the others
    # the paired bootstrap only (whatever values a run happens to hold).
    binary_metrics: ClassVar[tuple[str, ...]] = ("accuracy",)
    # Whether ``--seed`` changes the task's instances (HotpotQA's distractors and random positions); where it does
    # not, runs that differ only in --seed are the same run, never pooled as seed replicates.
    seed_reaches_data: ClassVar[bool] = False
    condition: ClassVar[str] = "condition"  # what results are grouped by: a column of the results table
    default_template: ClassVar[str] = ""
    retrieval_template: ClassVar[str | None] = None  # with --retrieval; None: the task has no retrieval prompt
    stop: list[str] = []
    include_stop: ClassVar[bool] = False  # score the generation with the stop string that ended it
    needs_tokenizer: ClassVar[bool] = False  # the engine passes the model's tokenizer to the constructor
    default_max_new_tokens: int = 32
    # How harness.report shows the task (it names no task; these say it). The first of ``metrics`` is the one
    # drawn and the one ``--subset`` asks to be 1. The x axis: a per-condition statistic of the rows (HotpotQA:
    # the slot of the first gold paragraph, its named positions under their slot), or None: the condition's
    # value (``axis_position``). A condition of two parts (the needle's length@depth) is drawn as a heatmap whose
    # rows are its second part, titled ``series_label``.
    axis_statistic: ClassVar[str | None] = None
    axis_label: ClassVar[str | None] = None  # the x axis' title (default: the condition's name)
    series_label: ClassVar[str | None] = None
    official_scorer: ClassVar[str | None] = None  # the task's own scoring script, if it has one (see official_gold)

    def __init__(self, data: str | None = None, split: str | None = None, tokenizer=None, **options):
        """``tokenizer``: the model's, for a task that ``needs_tokenizer`` (given at construction; a task is not
        changed afterwards)."""
        self.data, self.split, self.tokenizer = data, split, tokenizer
        self.options = make_options(self.Options, options, self.name)

    @abstractmethod
    def load(self) -> list[dict]:
        """Every row of the data, each with a unique ``_id``: its content hash keys the run's resume check."""

    @abstractmethod
    def instances(self, rows: list[dict], *, seed: int, pool_rows: list[dict] | None = None) -> list[Instance]:
        """The prompts to run for the selected ``rows``; ``pool_rows`` is the whole data (e.g. for distractors)."""

    @abstractmethod
    def score(self, instance: Instance, generation: str, answer_phrase: str | None = None) -> dict[str, Any]:
        """``{"prediction", "answer_found", <metric>: value, ...}`` for every name in ``metrics``."""

    def template_vars(self, instance: Instance) -> dict[str, Any]:
        return instance.template_vars()

    def make_tool(self, instance: Instance, spec: ToolSpec):
        """The tool bound to this instance's context, or None."""
        return None

    def record_fields(self, instance: Instance) -> dict[str, Any]:
        """Extra fields for the instance's samples.jsonl line (HotpotQA: where the gold paragraphs start)."""
        return {}

    def evidence(self, instance: Instance) -> list[tuple[str, str]]:
        """Texts of the prompt a reader should see marked, with a label each (HotpotQA: the gold paragraphs and
        their slots, and the question): the engine records where they stand in the prompt, the HTML report's
        sample explorer highlights them."""
        return []

    def write_outputs(self, records: list[dict], out_dir: Path, conditions: list[str]) -> list[str]:
        """Task-specific files in the run directory (HotpotQA: official prediction files); their names."""
        return []

    @classmethod
    def check_given(cls, given: dict) -> None:
        """Refuse options given together that cannot work together (``given``: what the user set)."""

    @classmethod
    def label(cls, option: str, value) -> str:
        """How a report's legend names a run by one of this task's options where runs differ in it."""
        return f"{option}={value}"

    @classmethod
    def axis_position(cls, condition: str, statistic: float | None = None) -> tuple[float | None, float | None]:
        """Where a condition sits on the report's plot, as numbers: its x (the axis statistic where the task has
        one, else ``NAME=VALUE``'s value (pairs, nodes, length) or the condition itself) and, for a two-part
        condition, its heatmap row (None: one line per run)."""
        if statistic is not None and statistic == statistic:
            return float(statistic), None
        try:
            return float(condition.split("=", 1)[-1]), None
        except ValueError:
            return None, None

    @classmethod
    def official_gold(cls, config: dict, resolved: dict, scored: dict[str, set[str]]) -> dict[str, list[dict]]:
        """The gold file ``official_scorer`` reads, per condition, cut to the ids the harness scored there
        (``scored``), from the data the run used (``config``; ``resolved`` holds its content hash). Only for tasks
        with an official scorer."""
        raise OptionError(f"task {cls.name!r} has no official scoring script")

    @classmethod
    def output_tag(cls, options: dict) -> str:
        """What the default run directory's name adds for these (checked) options, e.g. HotpotQA's ``-k10``."""
        return ""

    def describe(self, template_variables: set[str] | None = None) -> str:
        """A short line for the run summary (``template_variables``: what the run's template reads)."""
        opts = dataclasses.asdict(self.options)
        return ", ".join(f"{k}={v}" for k, v in opts.items()) or "no options"


def make_options(options_cls: type, values: dict[str, Any], task: str = ""):
    """Build a task's Options from loose values (strings from the command line, or typed values), converting
    each to its field's type; an unknown key or a value that does not convert is an OptionError."""
    hints = typing.get_type_hints(options_cls)
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    known = set(fields)
    out = {}
    for key, value in values.items():
        if key not in known:
            raise OptionError(f"--task-arg {key}={value}: task {task!r} has no option {key!r}; its options: "
                              f"{', '.join(sorted(known)) or 'none'}")
        out[key] = _convert(value, hints[key], f"--task-arg {key}={value}")
    opts = options_cls(**out)
    check = getattr(opts, "check", None)
    if check is not None:  # the task's own checks first: their messages name its own flags (HotpotQA's --shots)
        check()
    for key, value in values.items():
        _check_value(key, value, out[key], fields[key])
    return opts


def _check_value(key: str, given: Any, value: Any, field: dataclasses.Field) -> None:
    """What every option obeys unless its field says otherwise: numbers are not negative (``metadata["min"]``
    sets another least value, None none) and a list names each value once (``metadata["repeats"]``)."""
    least = field.metadata.get("min", 0)
    items = value if isinstance(value, list) else [value]
    if least is not None:
        low = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool) and v < least]
        if low:
            raise OptionError(f"--task-arg {key}={given}: {low[0]} is below {least}; give {least} or more")
    if isinstance(value, list) and not field.metadata.get("repeats"):
        seen = [v for i, v in enumerate(value) if v in value[:i]]
        if seen:
            raise OptionError(f"--task-arg {key}={given}: {seen[0]} is given twice; give each value once")


def _convert(value: Any, typ, where: str):
    origin = typing.get_origin(typ)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        if value is None or value == "none":
            return None
        return _convert(value, args[0], where)
    if origin is list:
        items = value.split(",") if isinstance(value, str) else list(value)
        return [_convert(v.strip() if isinstance(v, str) else v, args[0], where) for v in items if str(v).strip()]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes"):
            return True
        if str(value).lower() in ("0", "false", "no"):
            return False
        raise OptionError(f"{where}: expected true or false")
    if typ in (int, float, str):
        try:
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return typ(value)
        except (TypeError, ValueError):
            raise OptionError(f"{where}: expected {'an integer' if typ is int else 'a number' if typ is float else 'text'}")\
                from None
    return value


def options_help(options_cls: type) -> str:
    """``name (type, default): help`` for each option: the CLI's --task-arg help."""
    hints = typing.get_type_hints(options_cls)
    parts = []
    for f in dataclasses.fields(options_cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        t = getattr(hints[f.name], "__name__", str(hints[f.name]).replace("typing.", ""))
        parts.append(f"{f.name} ({t}, default {default}): {f.metadata.get('help', '')}".rstrip(": "))
    return "; ".join(parts)


def word_level_tokenizer(vocab: list[str], pad: str = "[PAD]", bos: str = "[BOS]", unk: str = "[UNK]"):
    """A whitespace-separated, one-id-per-word tokenizer for the synthetic tasks' vocabularies. Its eos is the
    pad token: "[EOS]" separates the sections of a sample and must not end generation."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=pad, bos_token=bos, unk_token=unk,
                                   clean_up_tokenization_spaces=False)
    fast.padding_side = "left"
    return fast
