"""``python -m harness.doctor --suite gpu --out DIR``: what a GPU machine must prove, in one command, written to
``DIR/report.json`` and ``DIR/report.md``; exit status 1 on any parity failure.

GPU machines come rarely, briefly and without network, so the first command must prove everything at once. On
CUDA the models have the released checkpoints' shapes (random weights, the tiny BPE tokenizer: no download); on
a machine without CUDA the same checks run at tiny sizes on CPU and the report says so, and the test suite runs
them, so the suite cannot rot between GPU runs. Checks that need a GPU (CUDA graphs, the trainer on CUDA against
CPU, ``--batch-size auto``'s budget) are listed as skipped with the reason."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from harness.tools.fixture_prompts import fixture_prompts
from harness.backends.base import GenRequest
from harness.backends.generation import common_prefix
from harness.backends.loading import load_backend
from harness.backends.planner import forget_costs, plan_batches
from harness.backends.prefix_tree import PrefixTree
from harness.models.istree import build_model
from harness.ops.selective_scan import choose_scan
from harness.reports.plotting import pyplot, save
from harness.tiny import FAMILY_ARCHS, build_tokenizer, make_tiny_model
from harness.tools.checks import (
    check_cuda_graphs,
    check_phi_mamba_kernels,
    check_phi_mamba_reference,
    decode_table,
    environment,
    free_memory,
)
from harness.procs import project_env, python_result
from harness.training.config import TrainConfig
from harness.training.data import TrainTask, batch_from_tokens
from harness.training.grid import grid_cells, measure_cell
from harness.training.step import masked_loss
from retrieval import RetrievalTool

SIZES = {"real": {"hidden": 2048, "layers": 24}, "tiny": {"hidden": 64, "layers": 4}}
PARITY_ARCHS = ("phi", "phi-mamba", "hybrid-phi-mamba")
INIT_STD = {"real": 0.05, "tiny": 0.5}  # large enough that generations differ between prompts


def model_path(tmp: Path, arch: str, size: str, tok, **kw) -> str:
    return str(make_tiny_model(tmp / f"{arch}-{size}", arch, tokenizer=tok, max_positions=4096,
                               init_std=INIT_STD[size], real_heads=size == "real" and arch != "phi", **SIZES[size],
                               **kw))


# A divergence between two greedy runs is rounding, not a bug, when the two tokens were this close in the
# reference's own logits (in units of the logits' spread at that step): batching changes GEMM shapes and
# attention padding, so kernels add in another order. bf16 keeps 8 bits of mantissa; on an H100 its
# divergences had gaps of 1-6 bf16 steps at the logits' scale (under 0.09 of the spread), and transformers' own
# batched ``generate`` agreed with its per-sample runs on 9 of 24 fixture prompts. A masking or state bug
# moves logits by the spread itself.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.125}


@torch.inference_mode()
def divergences(backend, prompts: list[str], ref: list[list[int]], other: list[list[int]]) -> list[dict]:
    """For each row where ``other`` differs from ``ref``: the first differing step, and the gap there between
    the two tokens' logits when the reference's own tokens are fed (teacher forcing), with the logits' spread."""
    eos = backend.tokenizer.eos_token_id
    rows = []
    for i, (p, a, b) in enumerate(zip(prompts, ref, other)):
        if a == b:
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ta, tb = (a[k] if k < len(a) else eos), (b[k] if k < len(b) else eos)
        ids = backend.tokenizer(p)["input_ids"] + a[:k]
        logits = backend.sequence_logits(torch.tensor([ids], device=backend.device))[0, -1].float()
        rows.append({"row": i, "step": k, "gap": float(logits[ta] - logits[tb]), "spread": float(logits.std())})
    return rows


PARITY = "batched == no prefix reuse == prefix tree == alone"


def generation_parity(path: str, arch: str, device: str, dtype: str, prompts: list[str], new: int) -> dict:
    """Greedy generations: a batch with the shared prefix reused == the batch without it == the prefix tree's
    (each prompt prefilled alone after its snapshot, rows merged) == each prompt alone. Exact, or (where kernels
    round differently by batch shape) every divergence a near-tie of the logits."""
    backend = load_backend(path, device, dtype)
    reqs = [GenRequest(p, new) for p in prompts]
    shared = common_prefix([backend.tokenizer(p)["input_ids"] for p in prompts])
    batched = [r.token_ids for r in backend.generate(reqs, prefix_reuse="batch")]
    no_prefix = [r.token_ids for r in backend.generate(reqs)]
    tree = [r.token_ids for r in backend.generate(reqs, prefix_reuse="tree")]
    alone = [backend.generate([r])[0].token_ids for r in reqs]
    same = sum(a == b == c == d for a, b, c, d in zip(batched, no_prefix, tree, alone))
    distinct = len({tuple(t) for t in alone})
    div = sum((divergences(backend, prompts, alone, x) for x in (batched, no_prefix, tree)), [])
    worst = max((abs(d["gap"]) / max(d["spread"], 1e-12) for d in div), default=0.0)
    # an equality of identical outputs proves nothing: the generations must differ between prompts
    return {"name": f"{arch} {dtype}: {PARITY}", "same": f"{same}/{len(reqs)}",
            "distinct_generations": distinct, "shared_prefix_tokens": len(shared),
            "divergences": [f"row {d['row']} step {d['step']}: gap {d['gap']:.3g} (spread {d['spread']:.3g})"
                            for d in div],
            "worst_gap_over_spread": round(worst, 6), "near_tie": NEAR_TIE[dtype],
            "ok": distinct >= 2 and worst <= NEAR_TIE[dtype]}


def graphs_parity(path: str, arch: str, prompts: list[str], new: int) -> dict:
    """The real generation loop replaying decode steps from CUDA graphs against eager steps: rows leaving the
    batch (batch buckets), long prompts (context buckets) and tool calls whose tags the model really writes
    (multi-token result blocks written into the resident cache)."""
    eager = load_backend(path, "cuda", "float32", cuda_graphs="off")
    free = eager.generate([GenRequest(p, new) for p in prompts])
    units = [p[i:i + 120] for p in prompts[:2] for i in range(0, 600, 120)]

    def requests():  # a fresh tool per run: tools log their calls
        return [GenRequest(p, new - 4 * (i % 3), tool=RetrievalTool(units, max_calls=2, call_open=f.text[0:2],
                                                                      call_close=f.text[4:6]) if i % 2 == 0 else None)
                for i, (p, f) in enumerate(zip(prompts, free))]

    a = eager.generate(requests())
    # one backend through batch 1, then 64 rows (its buffers grow: new graphs, a new pool), then batch 1 again
    turns = [prompts[:1], (prompts * (64 // len(prompts) + 1))[:64], prompts[1:2]]
    eager_turns = [[r.token_ids for r in eager.generate([GenRequest(p, 8) for p in t])] for t in turns]
    del eager
    graphed = load_backend(path, "cuda", "float32", cuda_graphs="on")
    b = graphed.generate(requests())
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    graphed_turns = [[r.token_ids for r in graphed.generate([GenRequest(p, 8) for p in t])] for t in turns]
    turns_same = sum(x == y for e, g in zip(eager_turns, graphed_turns) for x, y in zip(e, g))
    return {"name": f"{arch}: CUDA-graph decode == eager in the generation loop (buckets, tool calls, one backend "
                    "at batch 1, 64, 1)",
            "same": f"{same}/{len(a)}", "turns_same": f"{turns_same}/{sum(map(len, turns))}",
            "tool_spans": sum(len(x.tool_spans) for x in a),
            "distinct_generations": len({tuple(x.token_ids) for x in a}),
            "ok": same == len(a) and turns_same == sum(map(len, turns))}


def family_parity(device: str, tmp: Path, tok) -> dict:
    """Every transformers family of the capability table (tiny configs): a batch of 4 == each prompt alone."""
    prompts = [f"Question {i}: which river runs through the town of Karvell{'?' * i}" for i in range(4)]
    failed, distinct = [], {}
    for arch in FAMILY_ARCHS:
        path = make_tiny_model(tmp / f"family-{arch}", arch, tokenizer=tok, init_std=0.1 if arch == "lfm2" else 0.5)
        backend = load_backend(str(path), device, "float32")
        reqs = [GenRequest(p, 12) for p in prompts]
        batched = [r.token_ids for r in backend.generate(reqs)]
        alone = [backend.generate([r])[0].token_ids for r in reqs]
        distinct[arch] = len({tuple(t) for t in alone})
        if batched != alone:
            failed.append(arch)
        del backend
    return {"name": f"family matrix ({len(FAMILY_ARCHS)} families, float32): batch 4 == alone", "failed": failed,
            "distinct_generations": distinct, "ok": not failed}


def trainer_parity(device: str) -> dict:
    """One training step of each architecture: the loss and every gradient on ``device`` against the CPU."""
    cfg = TrainConfig(size="smoke", nodes=8, setup="cot", report_to="none").resolved()
    task = TrainTask(cfg)
    vocab = {t: i for i, t in enumerate(task.vocab)}
    stream = task.stream(seed=0)
    ids, mask = batch_from_tokens([next(stream) for _ in range(8)], vocab, "cpu")
    worst = {}
    for arch in ("transformer", "mamba", "hybrid"):
        torch.manual_seed(0)
        model = build_model(arch, "smoke", len(task.vocab))
        out = {}
        for dev in ("cpu", device):
            m = model.to(dev)
            m.zero_grad()
            loss = masked_loss(m(input_ids=ids.to(dev)).logits, ids.to(dev), mask.to(dev))
            loss.backward()
            out[dev] = (loss.item(), [p.grad.detach().cpu().clone() for p in m.parameters() if p.grad is not None])
        (l0, g0), (l1, g1) = out["cpu"], out[device]
        worst[arch] = max([abs(l0 - l1)] + [((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
                                            for a, b in zip(g0, g1)])
    return {"name": f"trainer: one step's loss and gradients on {device} == CPU (float32)",
            # triton where its kernels passed their check
            "mamba_scan": choose_scan((1, 1, 1), torch.device(device), torch.float32, 1).scan,
            "max_rel_diff": {k: f"{v:.2e}" for k, v in worst.items()}, "ok": all(v < 1e-3 for v in worst.values())}


def throughput(path: str, arch: str, device: str, dtype: str, prompts: list[str], new: int) -> dict:
    """Samples/s and tokens/s of the harness on the fixture prompts; for a transformers model also per-sample
    ``generate`` and ``generate`` on left-padded batches, with their texts checked against the harness's."""
    backend = load_backend(path, device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    reqs = [GenRequest(p, new) for p in prompts]
    sync()
    t = time.perf_counter()
    outs = backend.generate(reqs, prefix_reuse="batch")
    sync()
    harness_s = time.perf_counter() - t
    row = {"model": arch, "dtype": dtype, "samples": len(prompts), "prompt_tokens": sum(map(len, ids)),
           "harness_samples_per_s": round(len(prompts) / harness_s, 2),
           "harness_new_tokens_per_s": round(sum(o.new_tokens for o in outs) / harness_s, 1)}
    if arch == "phi":  # transformers' own generate, the baseline a user would reach for
        model = backend.model
        tok = backend.tokenizer
        eos = tok.eos_token_id
        sync()
        t = time.perf_counter()
        alone = []
        for i in ids:
            x = torch.tensor([i], device=device)
            alone.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                        pad_token_id=eos)[0, len(i):].tolist())
        sync()
        row["generate_per_sample_samples_per_s"] = round(len(prompts) / (time.perf_counter() - t), 2)
        enc = tok(prompts, return_tensors="pt", padding=True).to(device)
        sync()
        t = time.perf_counter()
        padded = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=eos)
        sync()
        row["generate_padded_batch_samples_per_s"] = round(len(prompts) / (time.perf_counter() - t), 2)
        cut = [a[:a.index(eos)] if eos in a else a for a in alone]
        row["same_tokens_as_generate"] = f"{sum(o.token_ids == c for o, c in zip(outs, cut))}/{len(outs)}"
        # transformers' own batching against its own per-sample runs: how much bf16 alone moves greedy tokens
        width = enc["input_ids"].shape[1]
        agree = sum(p[width:].tolist()[:len(a)] == a for p, a in zip(padded, alone))
        row["generate_batch_same_as_per_sample"] = f"{agree}/{len(alone)}"
        row["speedup_vs_per_sample"] = round(row["harness_samples_per_s"] / row["generate_per_sample_samples_per_s"], 2)
        del model
    return row


PLANS = ("auto", "tree-rows", "tree-block", "batch", "none")


def plan_sweep(path: str, arch: str, device: str, dtype: str, prompts: list[str], new: int,
               plans: tuple[str, ...] = PLANS, repeats: int = 1) -> list[dict]:
    """The all-slot sweep (gold at every slot) through each prefill plan and the default (``auto``, its cost
    model measured inside the timing, as a run does), ``repeats`` times in alternating order: median seconds,
    tokens prefilled, speed against ``batch``, auto's regret (its time over the fastest forced plan's, less one),
    and whether its generations are ``none``'s (``same_as_none``: equal, or every divergence a near-tie, where the
    dtype rounds by batch shape), with how many generations differ between prompts (an equality of identical
    outputs proves nothing) and from ``none``'s."""
    backend = load_backend(path, device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    backend.generate([GenRequest(p, 2) for p in prompts[:2]])  # first-call costs out of the timings
    times: dict[str, list[float]] = {plan: [] for plan in plans}
    runs = {}
    for rep in range(repeats):
        for plan in plans if rep % 2 == 0 else plans[::-1]:  # alternating: drift lands on every plan alike
            forget_costs(backend, remembered=True)  # auto measures, as a machine's first run does
            sync()
            t = time.perf_counter()
            gen = backend.generate_all([GenRequest(p, new, prompt_ids=i) for p, i in zip(prompts, ids)],
                                       batch_size="auto", prefix_reuse=plan)
            out = [r.token_ids for r in gen.results(len(prompts))]
            sync()
            times[plan].append(time.perf_counter() - t)
            runs[plan] = (statistics.median_high(times[plan]), gen.plan, out)
    base = runs["batch"][0]
    forced = [sec for plan, (sec, _, _) in runs.items() if plan != "auto"]
    ref = runs["none"][2]
    tree_tokens = PrefixTree(ids).tree_tokens
    rows = []
    for plan, (sec, record, out) in runs.items():
        # where kernels round differently by batch shape (bf16), a divergence must be a near-tie of the logits
        div = divergences(backend, prompts, ref, out)
        worst = max((abs(d["gap"]) / max(d["spread"], 1e-12) for d in div), default=0.0)
        rows.append({"model": arch, "dtype": dtype, "prompts": len(prompts), "plan": plan, "ran": record.ran,
                     "seconds": round(sec, 2), "runs": len(times[plan]),
                     "spread": round((max(times[plan]) - min(times[plan])) / sec, 3),
                     "speedup_vs_batch": round(base / sec, 2),
                     **({"regret": round(sec / min(forced) - 1, 3)} if plan == "auto" and forced else {}),
                     "prefilled_over_tree": round(record.prefill_tokens / tree_tokens, 2),
                     "distinct_generations": len({tuple(t) for t in out}), "differs_from_none": len(div),
                     "worst_gap_over_spread": round(worst, 4),
                     "same_as_none": out == ref or worst <= NEAR_TIE[dtype]})
    return rows


def auto_batch(path: str, arch: str, device: str, dtype: str, prompts: list[str], new: int) -> dict:
    """``probe_auto_batch`` in a child process: a search that runs the GPU to its limit must not take the suite's
    CUDA context with it (an illegal address, unlike an out-of-memory error, leaves the context unusable)."""
    code = ("import json, sys; from harness.tools.gpu_suite import probe_auto_batch; "
            "print('RESULT ' + json.dumps(probe_auto_batch(*json.load(sys.stdin))))")
    got, res = python_result(code, stdin=json.dumps([path, arch, device, dtype, prompts, new]), timeout=600,
                             env=project_env())
    if res.returncode or got is None:
        raise RuntimeError(f"the probe exited {res.returncode}: {res.stderr.strip()[-1500:]}")
    return got


def probe_auto_batch(path: str, arch: str, device: str, dtype: str, prompts: list[str], new: int) -> dict:
    """The batch ``--batch-size auto`` packs from free GPU memory against the largest batch of the same prompts
    that really fits (doubling from the auto batch until CUDA runs out of memory, at most 1,024)."""
    backend = load_backend(path, device, dtype)
    many = (prompts * (1024 // len(prompts) + 1))[:1024]
    lengths = [len(backend.tokenizer(p)["input_ids"]) for p in many]
    picked = max(len(b) for b in plan_batches(lengths, "auto", backend.token_budget(), new))
    largest, b = 0, max(1, picked)
    while b <= len(many):
        try:
            backend.generate([GenRequest(p, new) for p in many[:b]])
            largest, b = b, 2 * b
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
    return {"model": arch, "dtype": dtype, "auto_batch": picked, "largest_that_fits": largest,
            "cache_bytes_per_token": backend.bytes_per_token(),
            "prefill_bytes_per_token": backend.prefill_bytes_per_token(),
            "note": "largest: doubling from the auto batch, at most 1,024" + (" (all fit)" if largest == len(many)
                                                                              else "")}


def trainer_projection(cuda: bool) -> str:
    """benchmarks/train_throughput.py's table and the paper grid's projected hours on this device."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"
    args = ["--measure-batch", "64", "--steps", "2"] if cuda else ["--nodes", "4", "--setups", "direct",
                                                                   "--measure-batch", "2", "--steps", "1"]
    try:
        res = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                             env=project_env())
    except subprocess.TimeoutExpired:
        return "timed out after 300 s"
    return res.stdout.strip() if res.returncode == 0 else f"failed: {res.stderr.strip()[-1500:]}"


def trainer_throughput(device: torch.device, cells: list) -> list[dict]:
    rows = []
    for cell in cells:
        m = measure_cell(cell, device, cell.batch_size, steps=2)
        rows.append({"cell": cell.name, "samples_per_s": round(cell.batch_size / m["step_s"], 1),
                     "data_share": round(m["gen_s_per_sample"] * cell.batch_size
                                         / (m["gen_s_per_sample"] * cell.batch_size + m["step_s"]), 3)})
    return rows


def _guarded(name: str, fn, *args) -> dict:
    """One check or measurement; an exception is recorded as its failure, so the rest of a scarce GPU session's
    suite still runs and reports."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"name": name, "model": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:]}
    finally:

        free_memory()


PARTS = ("parity", "throughput", "decode", "trainer")  # each fits one 10-minute call on an H100


def run_suite(out: Path, size: str | None = None, parts: tuple[str, ...] = PARTS) -> int:
    """The checks and measurements of ``parts``; returns the exit status (1 on any parity failure). The report is
    rewritten after every step, so a call cut off at the machine's time limit still leaves what it proved."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    size = size or ("real" if cuda else "tiny")
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"environment": environment(), "device": device, "size": size, "parts": list(parts),
                    "checks": [], "skipped": [], "throughput": [], "plans": [], "auto_batch": [], "decode": [],
                    "trainer": []}
    if not cuda:
        report["skipped"].append("no CUDA here: every check ran at tiny sizes on CPU; CUDA graphs, the trainer on "
                                 "CUDA against CPU and --batch-size auto's memory budget need a GPU")
    t0 = time.perf_counter()

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "report.md").write_text(render(report))

    def step(into: list, name: str, fn, *args) -> None:
        t = time.perf_counter()
        row = _guarded(name, fn, *args)
        into.extend(row) if isinstance(row, list) else into.append(row)
        verdict = "" if not isinstance(row, dict) or "ok" not in row else ("PASS " if row["ok"] else "FAIL ")
        print(f"[{time.perf_counter() - t0:6.0f}s] {verdict}{name} ({time.perf_counter() - t:.0f}s)"
              + (f": {row['error']}" if isinstance(row, dict) and "error" in row else ""), flush=True)
        save()

    with tempfile.TemporaryDirectory() as d:
        tmp, tok = Path(d), build_tokenizer()
        if "parity" in parts or "throughput" in parts:
            _models_part(step, report, parts, device, size, tmp, tok)
        if "parity" in parts:
            _parity_part(step, report, device, tmp, tok)
    if "decode" in parts:
        step(report["decode"], "decode table", decode_table, device, size,
             (512, 2048, 8192) if cuda else (64, 256), 8, (1, 8, 64) if cuda else (1, 4))
        measured = [r for r in report["decode"] if "tokens_per_s" in r]
        if measured:
            plot_decode(measured, out / "decode.png", report["environment"].get("gpu", "CPU"))
    if "trainer" in parts:
        cells = [c for c in grid_cells("paper" if cuda else "smoke", TrainConfig(), out)
                 if c.size in ("0.5M", "smoke") and c.nodes in (16, 4)]
        step(report["trainer"], "trainer throughput", trainer_throughput, torch.device(device), cells)
        if cuda:
            report["trainer_projection"] = trainer_projection(cuda)
        else:  # tiny CPU cells project nothing about a GPU; the benchmark itself is tested on its own
            report["skipped"].append("the paper grid's projection: a GPU's number (on CPU, python "
                                     "benchmarks/train_throughput.py prints this machine's)")
        save()
    print(render(report))
    print(f"\nwrote {out / 'report.json'}, {out / 'report.md'}")
    return 1 if any(not c["ok"] for c in report["checks"]) else 0


def _models_part(step, report: dict, parts, device: str, size: str, tmp: Path, tok) -> None:
    """Phi-1.5-, Phi-Mamba- and hybrid-shaped models: generation parity and CUDA graphs (parity), the harness
    against ``generate`` and ``--batch-size auto`` against what fits (throughput)."""
    cuda = device == "cuda"
    prompts = fixture_prompts(10 if size == "real" else 2, 8 if size == "real" else 2)
    slots = ",".join(str(k) for k in range(11 if size == "real" else 3))  # the gold pair at every slot
    sweep = fixture_prompts(10 if size == "real" else 2, 12 if size == "real" else 2, positions=slots)
    new = 32 if size == "real" else 12
    dtypes = ["float32", "bfloat16"] if cuda else ["float32"]
    for arch in PARITY_ARCHS:
        path = model_path(tmp, arch, size, tok)
        if "parity" in parts:
            for dtype in dtypes:
                step(report["checks"], f"{arch} {dtype}: {PARITY}", generation_parity,
                     path, arch, device, dtype, prompts[:8], new)
            if cuda:
                step(report["checks"], f"{arch}: CUDA graphs in the generation loop", graphs_parity, path, arch,
                     prompts[:8], new)
        if "throughput" in parts:
            step(report["throughput"], arch, throughput, path, arch, device, dtypes[-1], prompts, new)
            step(report["plans"], f"{arch} prefill plans", plan_sweep, path, arch, device, dtypes[-1], sweep, new)
            if cuda:
                step(report["auto_batch"], arch, auto_batch, path, arch, device, dtypes[-1], prompts, new)


def _parity_part(step, report: dict, device: str, tmp: Path, tok) -> None:
    """The Phi-Mamba reference and kernels, CUDA-graph steps, the trainer on CUDA against CPU, the family matrix."""

    checks, cuda = report["checks"], device == "cuda"
    step(checks, "phi-mamba reference: batched == alone", check_phi_mamba_reference, device)
    if cuda and report["environment"].get("phi_mamba_scan") != "pytorch reference":
        step(checks, "mamba-ssm kernels == reference", check_phi_mamba_kernels, "cuda")
    else:
        report["skipped"].append("mamba-ssm kernels == reference: no mamba-ssm kernels here (on CPU: "
                                 "python -m harness.doctor --interpret-kernels)")
    if cuda:
        step(checks, "CUDA graphs == eager (steps)", check_cuda_graphs, "cuda")
        step(checks, "trainer on CUDA == CPU", trainer_parity, "cuda")
    step(checks, "family matrix", family_parity, device, tmp, tok)


def plot_decode(rows: list[dict], path: Path, where: str) -> Path:
    """Decode tokens/s against context, one panel per batch size, each model's line beside its bandwidth bound."""
    plt = pyplot()

    batches = sorted({r.get("batch", 1) for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        mine = [r for r in rows if r.get("batch", 1) == b]
        for i, model in enumerate(dict.fromkeys(r["model"] for r in mine)):
            pts = sorted((r["context"], r["tokens_per_s"], r["bound_tokens_per_s"]) for r in mine if r["model"] == model)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=model)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"batch {b}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s (dotted: bandwidth bound)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode on {where}", fontsize=10)
    save(fig, path, dpi=130)
    return path


def render(report: dict) -> str:
    """report.md: environment, checks, skips, throughput, decode and trainer tables."""
    import pandas as pd

    env = report["environment"]
    lines = [f"# GPU suite on {env.get('gpu', 'CPU')} ({report['size']} models, {report.get('seconds')} s)", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "", "## Checks", ""]
    for c in report["checks"]:
        detail = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("name", "ok", "traceback"))
        lines.append(f"- **{'PASS' if c['ok'] else 'FAIL'}** {c['name']} ({detail})")
    lines += [f"- SKIP {s}" for s in report["skipped"]]
    for title, key in (("Throughput (fixture prompts, 4-shot)", "throughput"),
                       ("Prefill plans on the all-slot sweep (auto: the default)", "plans"),
                       ("--batch-size auto against the largest batch that fits", "auto_batch"),
                       ("Decode against the memory-bandwidth bound (of_bound: the share of it reached)", "decode"),
                       ("Trainer samples/s", "trainer")):
        if report.get(key):
            table = pd.DataFrame(report[key]).drop(columns=["traceback", "ok", "name"], errors="ignore")
            lines += ["", f"## {title}", "", table.fillna("n/a").to_markdown(index=False)]
            if key == "decode":
                lines += ["", "![decode](decode.png)"]
    if report.get("trainer_projection"):
        lines += ["", "## The paper grid on this device (benchmarks/train_throughput.py)", "", "```",
                  report["trainer_projection"], "```"]
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    lines += ["", f"**{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'}**"]
    broken = [f"{key} {r.get('model', '')}: {r['error']}" for key in ("throughput", "plans", "auto_batch", "decode",
                                                                        "trainer")
              for r in report.get(key, []) if "error" in r]
    lines += [f"- measurement failed: {b}" for b in broken]
    return "\n".join(lines) + "\n"
