"""Shared test helpers (the only place test files share code from): a guard that makes equality tests
meaningful, a scripted model, a fake vLLM engine, and the prompts, requests and tools several files use.

``ScriptedBackend`` runs a real backend's forward passes (cache, padding, prefix copies and tool-result
blocks all real) but replaces each row's next-token logits with a one-hot on the token a script says the
model writes next, so the tool loop can be driven exactly as a model imitating the exemplars would drive it."""
from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

import torch

from evals.fixture import FIXTURE_PATH
from harness.backends.base import GenRequest, StepModel
from harness.backends.step import StepBackend
from retrieval import RetrievalTool
from retrieval.tool import RESULT_CLOSE


def run_config(model_dir, out, **overrides):
    """A small fixture-data RunConfig for a tiny model on CPU; tests override what they vary."""
    from harness.engine.config import RunConfig

    task_args = {"distractors": 4, "positions": ["first", "last"]}
    for name in ("distractors", "positions", "shots"):  # HotpotQA's options, given like its flags
        if name in overrides:
            task_args[name] = overrides.pop(name)
    if task_args["distractors"] == 0:
        task_args.pop("positions")
    base = dict(model=model_dir, task="hotpotqa", data="fixture", task_args=task_args, limit=6,
                max_new_tokens=12, device="cpu", dtype="float32", output=str(out), batch_size="4")
    base.update(overrides)
    return RunConfig(**base)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped, does not count). Linux: reads /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def assert_varied(values: Sequence, what: str = "generations") -> None:
    """Equality across batch sizes, caches or ranks proves little if every prompt gives the same output."""
    values = list(values)
    distinct = len(set(map(repr, values)))
    assert distinct * 2 >= len(values), f"only {distinct} distinct {what} among {len(values)}: the comparison is vacuous"


class EachBatch:
    """A real backend whose ``generate_all`` calls ``before(k)`` before it hands over its k-th batch (counted
    in ``calls``): a kill or a disk change between batches, as a run meets them."""

    def __init__(self, inner, before: Callable[[int], None]):
        self.inner, self.before, self.calls = inner, before, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate_all(self, requests, **kw):
        from harness.backends.base import Generation

        gen = self.inner.generate_all(requests, **kw)

        def batches():
            for item in gen:
                self.before(self.calls)
                self.calls += 1
                yield item

        return Generation(gen.plan, batches())


class _Row:
    def __init__(self, fed: list[int]):
        self.fed = list(fed)
        self.prompt_len: int | None = None


class ScriptedBackend(StepBackend):
    """``script_for(prompt_text)`` gives the segments the model writes: segment k is what it writes after the
    k-th tool result (a segment may run past a call's closing tag, as ``</search><result>`` does; the engine
    must cut it). After the last segment the model writes EOS. ``None`` for a text that is not a prompt."""

    name = "scripted"

    def __init__(self, inner: StepBackend, script_for: Callable[[str], list[str]]):
        self.inner, self.script_for = inner, script_for
        self.tokenizer, self.device, self.max_context = inner.tokenizer, inner.device, inner.max_context

    def describe(self):
        return self.inner.describe()

    def token_budget(self):
        return self.inner.token_budget()

    def prefix_exact(self):
        return self.inner.prefix_exact()

    def feeds_token_by_token(self, widths):
        return self.inner.feeds_token_by_token(widths)

    # stepper ---------------------------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask):
        logits, state = self.inner.prefill(input_ids, attention_mask)
        rows = [_Row(ids[m.bool()].tolist()) for ids, m in zip(input_ids, attention_mask)]
        return self._choose(logits, rows), (state, rows)

    def step(self, state, input_ids, attention_mask):
        inner, rows = state
        logits = self.inner.step(inner, input_ids, attention_mask)
        block_mask = attention_mask[:, -input_ids.shape[1]:]
        for row, ids, m in zip(rows, input_ids, block_mask):
            row.fed += ids[m.bool()].tolist()
        return self._choose(logits, rows)

    def select(self, state, keep):
        inner, rows = state
        return self.inner.select(inner, keep), [rows[k] for k in keep.tolist()]

    def expand(self, state, n):
        inner, rows = state
        return self.inner.expand(inner, n), [_Row(rows[0].fed) for _ in range(n)]

    def _choose(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        out = torch.full_like(logits, -1e4)
        for b, row in enumerate(rows):
            if row.prompt_len is None:
                row.prompt_len = len(row.fed)  # the first choice follows the whole prompt
            nxt = self._next(row)
            if nxt is None:  # not a prompt the script knows (the shared prefix alone): the model's own logits
                out[b] = logits[b]
            else:
                out[b, nxt] = 0.0
        return out

    def _next(self, row: _Row) -> int | None:
        tok = self.tokenizer
        prompt = tok.decode(row.fed[:row.prompt_len])
        written = tok.decode(row.fed[row.prompt_len:])
        segments = self.script_for(prompt)
        if segments is None:
            return None
        k = written.count(RESULT_CLOSE)
        if k >= len(segments):
            return tok.eos_token_id
        since = written[written.rfind(RESULT_CLOSE) + len(RESULT_CLOSE):] if k else written
        seg = segments[k]
        assert seg.startswith(since), f"the model was fed {since!r}, which segment {k} {seg!r} does not start with"
        if len(since) == len(seg):
            return tok.eos_token_id
        enc = tok(seg, add_special_tokens=False, return_offsets_mapping=True)
        for tid, (start, _) in zip(enc["input_ids"], enc["offset_mapping"]):
            if start == len(since):
                return tid
        raise AssertionError(f"no token of segment {seg!r} starts at {len(since)} (fed {since!r})")


class FakeVLLMEngine:
    """vLLM's "continue these rows" contract, implemented independently of the harness's loop: greedy by full
    forward passes (no cache); a run ends when one of its stop strings occurs in the text of the run's tokens
    (the completing token kept, as ``include_stop_str_in_output`` keeps it), at EOS (in the ids or not: vLLM
    versions differ), or after ``max_tokens``."""

    def __init__(self, model, tokenizer, device="cpu", report_eos: bool = True):
        self.model, self.tokenizer, self.device, self.report_eos = model, tokenizer, device, report_eos
        self.runs = 0

    @torch.inference_mode()
    def next_token(self, seq: list[int]) -> int:
        out = self.model(input_ids=torch.tensor([seq], device=self.device))
        return int((out.logits if hasattr(out, "logits") else out[0])[0, -1].argmax())

    def __call__(self, seqs, max_tokens, stops):
        results = []
        for seq, budget, stop in zip(seqs, max_tokens, stops):
            self.runs += 1
            run: list[int] = []
            while len(run) < budget:
                tok = self.next_token(seq + run)
                if tok == self.tokenizer.eos_token_id:
                    run += [tok] if self.report_eos else []
                    break
                run.append(tok)
                text = self.tokenizer.decode(run)
                if any(s in text for s in stop):
                    break
            results.append(run)
        return results


def fake_vllm_backend(inner: StepBackend, report_eos: bool = True):
    """The real ``VLLMBackend.generate`` logic over a fake engine wrapping ``inner``'s model."""
    from harness.backends.vllm_backend import VLLMBackend

    backend = VLLMBackend.__new__(VLLMBackend)  # no vllm import, no GPU: only the engine is replaced
    backend.tokenizer, backend.max_context, backend.device, backend.stats = \
        inner.tokenizer, inner.max_context, inner.device, {}
    backend.engine = FakeVLLMEngine(inner.model, inner.tokenizer, inner.device, report_eos)
    backend.continue_rows = backend.engine
    backend.settings = {"enable_prefix_caching": True, "family": "fake"}
    backend.describe = inner.describe
    return backend


# -- prompts, requests and scripted tools several test files share -----------------------------------
def diverse_prompts(n=16, seed=0):
    text = FIXTURE_PATH.read_text()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(text) - 2000)
        out.append(text[start:start + rng.randrange(20, 1500)])
    return out


def reference_greedy(backend, prompt, max_new):
    """Greedy decoding by re-running the whole sequence each step: no padding, no cache."""
    ids = backend.tokenizer(prompt)["input_ids"]
    out = []
    for _ in range(max_new):
        logits = backend.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
        if int(logits.argmax()) == backend.tokenizer.eos_token_id:
            break  # the loop stops at EOS and does not keep it
        out.append(int(logits.argmax()))
    return out


UNITS = ["Alvar Everly: Alvar Everly (born 1886) is a poet from Harrowgate Fen, Ostland.",
         "Karvell: Karvell is a town in the north of Dunholm.",
         "Karvell: It was founded in 1018 on the banks of the Lisk river.",
         "Pellin: Pellin is a town in the north of Veloria."]


QUESTIONS = ["Which river runs through the old town?", "Who wrote it?",
             "In what year was the bridge over the harbour finished, and by whom?", "Where is the castle?",
             "What is the name of the dragon in the story of the silver meadow?", "Why?"]


HEADER = "Answer each question in one short sentence.\n\nQuestion: What colour is the sky?\nAnswer: Blue.\n\n"


class RecomputeReference(StepModel):
    """A stepper with no cache and no padding: each row's whole sequence runs alone at every step."""

    name = "recompute"

    def __init__(self, model):
        self.model = model

    def _logits(self, rows):
        return torch.stack([self.model(input_ids=torch.tensor([r])).logits[0, -1].float() for r in rows])

    def prefill(self, input_ids, attention_mask):
        rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        return self._logits(rows), rows

    def step(self, rows, input_ids, attention_mask):
        block = attention_mask[:, -input_ids.shape[1]:].bool()
        for r, ids, m in zip(rows, input_ids, block):
            r += ids[m].tolist()
        return self._logits(rows)

    def select(self, rows, keep):
        rows[:] = [rows[i] for i in keep.tolist()]
        return rows

    def expand(self, rows, n):
        raise AssertionError("the reference never shares a prefix")


class EchoTool:
    """Called whenever the model writes ``call_end``; answers with a text whose length depends on what the
    model wrote, so rows receive results of different lengths in the same step."""

    max_calls = 2

    def __init__(self, call_end: str, row: int):
        self.call_end, self.row = call_end, row

    def __call__(self, text: str, start: int = 0) -> str:
        return "<r>" + " ".join(str(i) for i in range(1 + (3 * self.row + len(text)) % 7)) + "</r>"


def family_requests(tok, tool_end=None, max_new=10):
    prompts = [f"{HEADER}Question: {q}\nAnswer:" for q in QUESTIONS]
    return [GenRequest(p, max_new, (), EchoTool(tool_end, i) if tool_end else None, prompt_ids=tok(p)["input_ids"])
            for i, p in enumerate(prompts)]


def result_fields(results):
    return [(r.text, r.token_ids, r.finish_reason, r.tool_spans) for r in results]


def generate_with(backend, requests, batch, reuse, batching="auto"):
    """Through the plan asked for (each falls back where it is not exact for the family, as a run's would);
    ``batching``: auto (continuous where the backend joins batches) or static."""
    return backend.generate_all(requests, batch_size=batch, prefix_reuse=reuse,
                                batching=batching).results(len(requests))


def tool_scenario(i: int, title_a: str, title_b: str, answer: str) -> tuple[list[str], list[str | None]]:
    """(segments the model writes, the patterns its calls must carry; None for a call that is an error)."""
    a, b = re.escape(title_a), re.escape(title_b)
    end = f" So the answer is: {answer}."
    if i % 4 == 0:  # exemplar style: the closing tag and the next opening tag written adjacent
        return [f" Let me look.<search>{a}</search><result>", end], [a]
    if i % 4 == 1:  # two searches back to back: ``><`` completes the first and opens the second
        return [f"<search>{a}</search><search>{b}</search><result>", f"<search>{b}</search><result>", end], [a, b]
    if i % 4 == 2:  # a stray closing tag, then a real call
        return [" Nothing yet </search>", f" Now<search>{a}</search><result>", end], [None, a]
    # an anchored pattern right after a result: parsed from the new text only, never across the result
    return [f"<search>{a}</search><result>", f"<search>^{b}</search><result>", end], [a, f"^{b}"]


def sweep_prompts(n_slots=5):
    """A position sweep in miniature: a shared header, then paragraphs with the odd one at every slot."""
    head = "Answer from the paragraphs.\n" + "\n".join(UNITS[:2]) + "\n"
    fill = [f"Note {k}: the river at mile {3 * k} is {['wide', 'slow', 'cold', 'deep', 'green'][k]}." for k in range(5)]
    gold = UNITS[2]
    prompts = []
    for q, ask in enumerate(("When was Karvell founded?", "Where is Pellin?")):
        for slot in range(n_slots):
            body = fill[:slot] + [gold] + fill[slot:]
            # the ending names the slot: tiny recurrent models answer from the last tokens, and must vary
            prompts.append(head + "\n".join(body) + f"\nQuestion {q}: {ask} ({fill[slot][:12 + 3 * slot]})\nAnswer:")
    return prompts


def long_front_prompts(tokenizer) -> tuple[list[str], int]:
    """The sweep behind a front long enough for a CPU's decoding steps to read it once for all merged rows, and
    how many leading tokens the prompts share."""
    from harness.backends.generation import common_prefix

    head = "Read every paragraph first.\n" + "\n".join(UNITS * 3) + "\n"
    prompts = [head + p for p in sweep_prompts()]
    return prompts, len(common_prefix([tokenizer(p)["input_ids"] for p in prompts]))


def spy(monkeypatch, owner, name: str, record: Callable) -> list:
    """``owner.name`` replaced by itself, each call's ``record(*args)`` appended to the list returned."""
    calls, real = [], getattr(owner, name)

    def counted(*args):
        calls.append(record(*args))
        return real(*args)

    monkeypatch.setattr(owner, name, counted)
    return calls


def stop_window(text: str, start: int) -> str:
    """Three characters the model writes, from ``start`` on, none of them U+FFFD: a stop string is matched
    against whole characters (vLLM's incremental detokenizer, like the harness, holds back a cut UTF-8 byte;
    the fake engine decodes every run whole and would see the U+FFFD one step early)."""
    for i in range(start, max(start + 1, len(text) - 2)):
        if "\ufffd" not in text[i:i + 3]:
            return text[i:i + 3]
    return text[start:start + 3]


def mixed_requests(backend, prompts, free):
    """Rows with a tool whose tags the model really writes, rows with a stop string it really writes (before or
    after a call), and free rows (EOS or the length limit)."""
    reqs = []
    for i, (p, f) in enumerate(zip(prompts, free)):
        tool = RetrievalTool(UNITS, max_calls=2, call_open=f.text[0:2], call_close=f.text[5:8]) if i % 3 == 0 else None
        stop = [stop_window(f.text, 12)] if i % 3 == 1 else (["\n\n"] if i % 3 == 0 else [])
        reqs.append(GenRequest(p, 32, stop=stop, tool=tool))
    return reqs


def _float64_scan(u, dt, A, B, C, D, z, bias):
    """The selective scan by its definition, in float64: the ground truth."""
    import torch.nn.functional as F

    delta = F.softplus(dt + bias[:, None])
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(u.shape[-1]):
        h = torch.exp(delta[..., t, None] * A) * h + (delta[..., t] * u[..., t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return (torch.stack(ys, -1) + D[:, None] * u) * F.silu(z)


def bf16_errors_against_float64(scan, reference, ratio: float = 1.3) -> dict:
    """bf16 activations, float32 parameters (as the trainer's autocast gives them) and Mamba's step-size biases:
    the outputs and gradients where ``scan``'s error against float64 exceeds ``ratio`` x ``reference``'s (both
    called as mamba-ssm's ``selective_scan_fn``), as {name: (scan's, reference's)}; empty when within."""
    import math

    g = torch.Generator().manual_seed(11)
    b, d, n, length = 2, 32, 8, 160
    step = torch.exp(torch.rand(d, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    bias = (step + torch.log(-torch.expm1(-step))).float()  # softplus^-1: Mamba's dt_proj.bias init, -6.9 ... -2.3
    assert -7 < bias.min() < -6 and -3 < bias.max() < -2
    A = -torch.exp(torch.rand(d, n, generator=g) * 3)
    acts = [torch.randn(b, d, length, generator=g), torch.randn(b, d, length, generator=g) * 0.5,
            torch.randn(b, n, length, generator=g), torch.randn(b, n, length, generator=g),
            torch.randn(b, d, length, generator=g)]
    u, dt, B, C, z = [t.bfloat16() for t in acts]
    D = torch.randn(d, generator=g)
    weight = torch.randn(b, d, length, generator=g, dtype=torch.float64)
    names = ["y", "du", "ddt", "dA", "dB", "dC", "dD", "dz", "dbias"]

    def run(fn, dtype=None):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (u, dt, A, B, C, D, z, bias)]
        uu, dd, AA, BB, CC, DD, zz, bb = leaves
        if fn is _float64_scan:
            y = fn(uu, dd, AA, BB, CC, DD, zz, bb)
        else:
            y = fn(uu, dd, AA, BB, CC, D=DD, z=zz, delta_bias=bb, delta_softplus=True)
        return [y, *torch.autograd.grad((y.double() * weight).sum(), leaves)]

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    truth = run(_float64_scan, torch.float64)
    assert truth[0].std() > 0.1 and all(t.abs().max() > 0 for t in truth[1:])
    ours, ref = run(scan), run(reference)
    err_ours = {k: rel(a, t) for k, a, t in zip(names, ours, truth)}
    err_ref = {k: rel(a, t) for k, a, t in zip(names, ref, truth)}
    return {k: (err_ours[k], err_ref[k]) for k in names if err_ours[k] > ratio * err_ref[k] + 1e-6}


def ctrl_c_reaches() -> None:
    """``preexec_fn`` of a child a test interrupts: SIGINT back to its default, as a terminal's Ctrl-C finds it. A
    command started in the background of a non-interactive shell (a CI step's ``cmd &``) inherits SIGINT ignored,
    and its children with it: the interrupted run would never stop, and the test would fail on the harness's
    behalf."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# A warm interpreter: scripts run in processes forked from one that has already imported torch and transformers.
# A fresh interpreter spends ~7 s of CPU on those imports before a tiny benchmark does anything (measured here:
# three quarters of a toy benchmark run), so thirteen benchmark runs paid ~90 s of CI for imports alone. Each run
# is still its own process (its pid, exit status, output, kill), forked from a server that never computed (one
# thread, no OpenMP pool), with the server's environment: a run that needs another environment starts fresh.
_WARM_SERVER = r"""
import json, os, runpy, sys, traceback
import torch, transformers
from transformers import PreTrainedModel  # the model classes' machinery: most of an import's time
import harness.backends.hf, harness.engine.run, harness.tiny
threads = len(os.listdir("/proc/self/task"))
print(json.dumps({"ready": threads == 1, "threads": threads}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req.get("exit"):
        break
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT),
                                    (2, req["err"], os.O_WRONLY | os.O_CREAT)):
                os.dup2(os.open(path, flags, 0o644), fd)
            sys.stdin = open(os.devnull)
            module = req["argv"][1] if req["argv"][0] == "-m" else None  # python -m M ... or python script ...
            sys.argv = req["argv"][1:] if module else req["argv"]
            sys.path[0] = req["cwd"] if module else os.path.dirname(os.path.abspath(req["argv"][0]))
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(req["argv"][0], run_name="__main__")
                code = 0
            except SystemExit as e:  # as the interpreter treats it
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""


class WarmPython:
    """``run(argv)`` as ``python *argv`` would (``[script, ...]`` or ``["-m", module, ...]``), in ``cwd``, in a
    process forked from a warm server started with ``env`` (one run at a time)."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-c", _WARM_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=self.env)
        self.ready = self._read(600)["ready"]

    def _read(self, timeout: float) -> dict:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm server ended (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, argv: list[str], env: dict, cwd, timeout: float):
        """``python *argv`` with ``env`` in ``cwd``: from the warm server where ``env`` is the one it was started
        with, else in a fresh interpreter. A ``subprocess.CompletedProcess`` either way."""
        if not self.ready or env != self.env:
            return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout)
        with tempfile.TemporaryDirectory() as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "out": out, "err": err}) + "\n")
            self.proc.stdin.flush()
            pid = self._read(60)["pid"]
            try:
                code = self._read(timeout)["status"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                code = self._read(60)["status"]
            with open(out) as o, open(err) as e:
                return subprocess.CompletedProcess(argv, code, o.read(), e.read())

    def close(self) -> None:
        """Asked to end, not sent an end of input: a process the test's own process forked meanwhile may hold the
        pipe's other end open (the end of input would never come)."""
        try:
            self.proc.stdin.write('{"exit": true}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
