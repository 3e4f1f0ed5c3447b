"""One run, as data: every flag of ``harness.eval`` lands in a RunConfig, which is written into results.json.

``validate`` checks every flag before anything is written; ``resolved`` turns the settings that decide a
sample's generation into content (the dtype and device type that will really be used, the data's and the
template's hashes; the engine adds the model's and tokenizer's files and the package versions from
``harness.engine.identity``), so two spellings of one run are one run and a resumed run can never mix rows made under
different settings."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.backends import BACKENDS, GRAPH_MODES, backend_class
from harness.backends.base import resolve_device
from harness.backends.loading import ResolvedModel
from harness.backends.planner import BATCHING, PREFIX_REUSE
from harness.backends.prefix_tree import parse_bytes
from harness.hashing import json_digest
from harness.models.registry import MODELS



class ConfigError(ValueError):
    """A flag's value cannot work; the message names the flag and the fix."""


def _f(default, help: str, **kw):
    """A field whose help text becomes its flag's (transformers.HfArgumentParser reads ``metadata``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# The flags that decide how rows are computed, never what they hold (outputs are identical across them): left out
# of the settings hash (``RunConfig.resolved``) and of a report's run labels. Every other flag is in the hash, as
# itself or as what it resolves to (a test keeps the two in step).
NOT_RESULT_DECIDING = ("output", "overwrite", "audit", "batch_size", "batching", "prefix_reuse", "prefix_memory")


@dataclass(frozen=True)
class RunConfig:
    """Every flag of ``harness.eval`` except the task's own options (``task_args``, see ``evals``), defined
    once: ``harness.eval`` builds its parser from these fields. Frozen: the engine resolves it once
    (``dataclasses.replace``) and run.json records the result."""

    model: str = _f(None, f"registered name ({', '.join(MODELS.names())}), a hub id (org/name) or a local "
                          "checkpoint dir", required=True)
    backend: str = _f("auto", "model backend (default: the registry's choice; vllm is an optional GPU extra)",
                      choices=["auto", *BACKENDS.names()])
    tokenizer: str | None = _f(None, "tokenizer: a hub id or local folder (default: the checkpoint's own; "
                                     "microsoft/phi-1_5's for goombalab-format folders, which carry none)")
    task: str = _f(None, "the task (see --task-arg for each task's options)", required=True)
    task_args: dict = field(default_factory=dict, metadata={"help": argparse.SUPPRESS})  # the task's options
    # (complete once resolved; set through --task-arg and the task's own flags, never directly)
    data: str | None = _f(None, "the task's data, for tasks that read a dataset: a file, 'fixture' (bundled "
                                "invented data) or 'hub' (see the task's --task-arg help; synthetic tasks draw theirs)")
    split: str | None = _f(None, "split when loading from the hub (default: the task's)")
    template: str | None = _f(None, "prompt template: a name in prompts/ or a path to a .j2 file (default: the "
                                    "task's)")
    limit: int | None = _f(None, "evaluate only the first N questions")
    ids: str | None = _f(None, "file of question ids (one per line, or a JSON list) to evaluate")
    batch_size: str = _f("auto", "prompts per batch, or 'auto' to fill batches up to a token budget")
    max_new_tokens: int | None = _f(None, "generation budget (default: the task's)")
    stop: list[str] | None = _f(None, "stop strings (default: the task's); repeatable", action="extend")
    device: str = _f("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = _f("auto", "auto, float32, bfloat16 or float16 (auto: bf16 on a GPU, float32 on CPU and for "
                            "the Phi-Mamba family)")
    seed: int = _f(1234, "seeds the data of tasks that draw with it (HotpotQA: distractors and random "
                         "positions); the synthetic tasks, the needle and IsTree draw their held-out sets with "
                         "--task-arg eval_seed=N, and runs that differ only in --seed there are one run to the report")
    output: str | None = _f(None, "run directory; rerunning with the same one resumes (default: "
                                  "runs/MODEL-TASK...)")
    retrieval: bool = _f(False, "let the model call the in-context regex search tool")
    max_tool_calls: int | None = _f(None, "tool calls allowed per sample, >= 1 (default: the task's)")
    tool_timeout: float = _f(1.0, "seconds before a regex search is stopped, > 0")
    tool_max_chars: int = _f(300, "cap on one tool result's length")
    prefix_reuse: str = _f("auto", "auto: the fastest of the others on this device and model (a measured cost "
                                   "model; the log and results.json say which ran and why); tree: every prefix "
                                   "prompts share is prefilled once (a prefix tree over all pending prompts, states "
                                   "kept at its branch points); batch: only the prefix all prompts share; none (also "
                                   "--no-prefix-reuse): every prompt prefilled whole. Outputs are identical in all",
                           choices=list(PREFIX_REUSE))
    batching: str = _f("auto", "continuous: rows that finish give their places in the batch to the next prompts; "
                               "static: each batch runs to its longest row; auto: continuous where the backend "
                               "can join batches and it pays (on a CPU not for a model whose layers mostly attend; "
                               "results.json says which ran and why). Outputs are identical in all", choices=list(BATCHING))
    prefix_memory: str = _f("auto", "memory the prefix tree's snapshots may hold, e.g. 4GiB (auto: a quarter of "
                                    "free memory); a snapshot that does not fit is recomputed, never an out-of-memory")
    cuda_graphs: str = _f("auto", "replay each decode step from a CUDA graph (one per batch and context "
                                  "bucket; the GPU suite checks it against the eager step): auto, on wherever a "
                                  "backend has graphs (on CUDA: Phi-Mamba, the hybrid and transformers' attention "
                                  "models; other families decode eagerly, logged); on (also the bare flag); compiled: "
                                  "on, each step compiled by TorchInductor first (fused kernels; checked against the "
                                  "eager step at each graph's first step, off for the run where they part); off",
                          choices=list(GRAPH_MODES), nargs="?", const="on")
    audit: int = _f(0, "after the run, generate N of its rows (drawn at random, seeded) again alone, unpadded, "
                       "without prefix reuse or CUDA graphs, in float32, and record in results.json how many agree")
    vllm_arg: list[str] = _f([], "an argument of vLLM's engine as KEY=VALUE, repeatable, with --backend vllm (e.g. "
                                 "enforce_eager=false, max_model_len=4096, kv_cache_memory_bytes=2000000000, "
                                 "enable_prefix_caching=false; in_process=false starts the engine in its own process); "
                                 "recorded, and in the settings hash unless it only sizes memory",
                             action="extend", metavar="KEY=VALUE")
    overwrite: bool = _f(False, "start over in --output even if it holds a run (of other settings, or this one): "
                                "its files are moved to OUTPUT/replaced-TIMESTAMP/, never deleted")
    template_sha256: str | None = field(default=None, metadata={"help": argparse.SUPPRESS})  # set by the engine

    def __post_init__(self):
        if isinstance(self.prefix_reuse, bool):  # the flag's former on/off form (run.json of 0.2 runs, scripts)
            object.__setattr__(self, "prefix_reuse", "tree" if self.prefix_reuse else "none")
        if isinstance(self.cuda_graphs, bool):  # the flag's former on/off form
            object.__setattr__(self, "cuda_graphs", "on" if self.cuda_graphs else "off")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise ConfigError for the first flag whose value cannot work."""
        def bad(flag, value, need):
            raise ConfigError(f"{flag} {value!r}: {need}")

        if not self.task:
            bad("--task", self.task, "give the task to run (python -m harness.eval --help lists them)")
        if self.batch_size != "auto" and not (str(self.batch_size).isdigit() and int(self.batch_size) > 0):
            bad("--batch-size", self.batch_size, "use a positive integer or 'auto'")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            bad("--max-new-tokens", self.max_new_tokens, "use a positive number of tokens (or leave it out for "
                "the task's default)")
        if self.limit is not None and self.limit < 1:
            bad("--limit", self.limit, "use a positive number of questions (or leave it out for all)")
        if not (isinstance(self.tool_timeout, (int, float)) and math.isfinite(self.tool_timeout)
                and self.tool_timeout > 0):
            bad("--tool-timeout", self.tool_timeout, "use a positive, finite number of seconds, e.g. 1.0")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            bad("--max-tool-calls", self.max_tool_calls, "use 1 or more (leave out --retrieval for no tool)")
        if self.prefix_reuse not in PREFIX_REUSE:
            bad("--prefix-reuse", self.prefix_reuse, f"use one of {', '.join(PREFIX_REUSE)}")
        if self.batching not in BATCHING:
            bad("--batching", self.batching, f"use one of {', '.join(BATCHING)}")
        if self.prefix_memory != "auto":
            try:
                parse_bytes(self.prefix_memory)
            except ValueError as e:
                bad("--prefix-memory", self.prefix_memory, str(e).split("; ", 1)[-1])
        if self.audit < 0:
            bad("--audit", self.audit, "use 0 (no audit) or a number of rows")
        if self.tool_max_chars < 4:
            bad("--tool-max-chars", self.tool_max_chars, "use 4 or more characters")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            bad("--stop", self.stop, "stop strings must be non-empty")
        if self.vllm_arg and not (self.backend in BACKENDS and backend_class(self.backend).takes_engine_args):
            takers = [n for n in BACKENDS.names() if backend_class(n).takes_engine_args]
            bad("--vllm-arg", " ".join(self.vllm_arg), f"applies to --backend {' or '.join(takers)} only")
        if self.cuda_graphs not in GRAPH_MODES:
            bad("--cuda-graphs", self.cuda_graphs, f"use one of {', '.join(GRAPH_MODES)}")
        if self.cuda_graphs in ("on", "compiled") and self.resolved_device().type != "cuda":
            bad("--cuda-graphs", self.cuda_graphs, "CUDA graphs need a CUDA device; leave the flag out (auto) on "
                "this machine")
        self.resolved_device()

    def resolved_device(self):
        try:
            dev = resolve_device(self.device)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"--device {self.device!r} is not a device torch knows ({e}); use auto, cpu, cuda, "
                              "cuda:N or mps") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device!r}: no CUDA GPU is visible to torch "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use "
                              "--device cpu or auto, or a CUDA build of torch on a GPU machine")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {self.device!r}: only {torch.cuda.device_count()} GPU(s) are visible")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ConfigError(f"--device {self.device!r}: MPS is not available here; use --device cpu or auto")
        return dev

    def resolved(self, data_sha256: str, template_sha256: str, model: ResolvedModel,
                 selects: tuple[str, ...] = ()) -> dict[str, Any]:
        """What determines a sample's generation, as content: the key of the resume hash. Limits, ids, batch
        size, prefix reuse (and its memory) and the task options in ``selects`` (conditions, e.g. positions) are left
        out: they choose which rows exist or how they are computed, not what a row holds. The dtype, device type
        and CUDA graphs are what ``model`` (resolved once, by the loader) resolved them to."""
        dev, dtype = model.device, model.dtype
        local = Path(self.model).expanduser()
        tok = Path(self.tokenizer).expanduser() if self.tokenizer else None
        # a local folder is identified by its files' content (harness.engine.identity), not by where it lies
        return {"model": "local folder" if local.is_dir() else self.model, "backend": self.backend,
                "tokenizer": "local folder" if tok is not None and tok.is_dir() else self.tokenizer,
                "task": self.task, "task_args": {k: v for k, v in self.task_args.items() if k not in selects},
                "data_sha256": data_sha256,
                "split": self.split, "template_sha256": template_sha256, "max_new_tokens": self.max_new_tokens, "dtype": dtype,
                "device_type": dev.type, "seed": self.seed, "stop": self.stop, "retrieval": self.retrieval,
                "max_tool_calls": self.max_tool_calls, "tool_timeout": float(self.tool_timeout),
                # graphs pad a batch to its bucket: GEMMs of another shape may round differently
                # (and a compiled step fuses kernels, which round in their own order)
                **({"cuda_graphs": "compiled" if model.compiled_decode else True} if model.graph_decode else {}),
                "tool_max_chars": self.tool_max_chars}


def task_arg_pairs(pairs: list[str]) -> dict[str, str]:
    """``--task-arg KEY=VALUE`` pairs as a dict; a malformed pair or a key given twice is refused (the later one
    would win silently)."""
    given: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--task-arg expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        if k in given:
            raise ConfigError(f"--task-arg {k} is given twice ({given[k]} and {v}); give it once (a sweepable "
                              f"option takes a comma list: {k}={given[k]},{v})")
        given[k] = v
    return given


def word_negative_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """HfArgumentParser gives ``--no-X`` the help of ``--X``; say what the negative flag does instead."""
    for action in parser._actions:  # noqa: SLF001  (argparse has no public way to edit an added flag)
        if isinstance(action, argparse._StoreFalseAction) and action.help:  # noqa: SLF001
            action.help = f"turn off --{action.dest.replace('_', '-')} ({action.help})"
    return parser


def settings_hash(resolved: dict[str, Any]) -> str:
    return json_digest(resolved)
