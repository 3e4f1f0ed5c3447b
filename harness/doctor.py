"""``python -m harness.doctor``: what this machine will run, and proof that each available path is right.

Run it on a new GPU box before a week-long evaluation. It prints the software found and the path each backend
takes, then, for every path available here, a parity check on tiny random models, and Phi-Mamba's decode
speed and state memory at 512 / 2k / 8k tokens of context. Exit status 1 if any check fails.

    python -m harness.doctor                       # what is here, and every check that can run here
    python -m harness.doctor --interpret-kernels   # also mamba-ssm's Triton kernels on CPU (interpreter; slow)

Checks: the Phi-Mamba reference path (chunked scan = recurrence, batched = alone); mamba-ssm kernels against
the reference (CUDA, or Triton's interpreter on CPU with ``--interpret-kernels``; prompt scan, decode step,
greedy tokens, Phi-Mamba and hybrid, left-padded batches); vLLM against transformers (CUDA with vllm)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.engine.identity import cache_dir

TOL = 1e-3  # max |logit difference| on tiny random models (float32)


def state_bytes(state) -> int:
    """Bytes of a decoding state: Phi-Mamba's conv+SSM (and KV) state, or a transformers KV cache."""
    if hasattr(state, "nbytes"):
        return state.nbytes()
    cache = state["cache"]
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _synchronizer(device):
    """Waits for queued GPU work before a clock is read (nothing to wait for on a CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def decode_cost(backend, length: int, steps: int, batch: int = 1) -> tuple[float, int]:
    """(seconds per decoding step, decoding-state bytes of the batch) after ``batch`` prompts of ``length``
    tokens."""
    vocab = backend.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, length), generator=g).to(backend.device)
    mask = torch.ones_like(ids)
    sync = _synchronizer(backend.device)
    with torch.inference_mode():
        logits, state = backend.prefill(ids, mask)
        tok = logits.argmax(-1, keepdim=True)
        for _ in range(3):  # warm-up
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            tok = backend.step(state, tok, mask).argmax(-1, keepdim=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            tok = backend.step(state, tok, mask).argmax(-1, keepdim=True)
        sync()
        per_token = (time.perf_counter() - t0) / steps
    return per_token, state_bytes(state)


# ------------------------------------------------------------------------------------------------ checks
def _tiny_phi_mamba(attn_layers, device, seed=0):
    from harness.models.phi_mamba import PhiMambaConfig, PhiMambaForCausalLM

    torch.manual_seed(seed)
    cfg = PhiMambaConfig.tiny(vocab_size=97, d_model=64, n_layer=2, attn_layers=attn_layers, chunk_size=16)
    model = PhiMambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)  # large enough that outputs depend on the whole prompt
    return model.to(device)


def _probe_prompts() -> list[list[int]]:
    """Three fixed random prompts of different lengths: a left-padded batch with real padding."""
    return [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 20, 5)]


def _run_paths(model, seqs, steps: int, scan: str, device, graphs=None) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                             list[list[int]]]:
    """Prefill a left-padded batch, then greedy-decode ``steps`` tokens (through ``graphs``, a GraphedDecode,
    when given); logits at real positions, per-step logits and tokens."""
    from harness.backends.generation import left_pad

    model.scan = scan
    ids, mask = left_pad(seqs, 0, device)
    with torch.inference_mode():
        logits, state = model(ids, mask)
        real = logits[mask.bool()]
        tok = logits[:, -1].argmax(-1, keepdim=True)
        step_logits, toks = [], [tok[:, 0].tolist()]
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(len(seqs), 1)], 1)
            if graphs is not None:
                last = graphs(state, tok, mask)
            else:
                out, state = model(tok, mask, state)
                last = out[:, -1]
            step_logits.append(last)
            tok = last.argmax(-1, keepdim=True)
            toks.append(tok[:, 0].tolist())
    return real, step_logits, toks


def check_phi_mamba_reference(device="cpu") -> dict:
    """The reference path against itself: a left-padded batch equals each prompt alone."""
    worst = 0.0
    for attn in ([], [1]):
        model = _tiny_phi_mamba(attn, device)
        seqs = _probe_prompts()
        batch = _run_paths(model, seqs, 6, "torch", device)
        for i, s in enumerate(seqs):
            alone = _run_paths(model, [s], 6, "torch", device)
            worst = max(worst, max((a[0] - b[i]).abs().max().item() for a, b in zip(alone[1], batch[1])))
    return {"name": "phi-mamba reference: batched == alone", "max_diff": worst, "ok": worst < TOL}


def check_phi_mamba_kernels(device) -> dict:
    """mamba-ssm's kernels (prompt scan and decode step) against the reference path."""
    from harness.models import kernels

    before = dict(kernels.CALLS)
    worst, same_tokens = 0.0, True
    for attn in ([], [1]):
        model = _tiny_phi_mamba(attn, device)
        seqs = _probe_prompts()
        ref = _run_paths(model, seqs, 4, "torch", device)
        ker = _run_paths(model, seqs, 4, "kernel", device)
        worst = max(worst, (ref[0] - ker[0]).abs().max().item(),
                    *((a - b).abs().max().item() for a, b in zip(ref[1], ker[1])))
        same_tokens &= ref[2] == ker[2]
    launched = {k: kernels.CALLS[k] - before[k] for k in kernels.CALLS}
    ok = worst < TOL and same_tokens and all(launched.values())
    return {"name": f"phi-mamba: mamba-ssm kernels == reference ({device})", "max_diff": worst,
            "same_tokens": same_tokens, "kernel_calls": launched, "ok": ok}


def check_cuda_graphs(device="cuda") -> dict:
    """Phi-Mamba's and the hybrid's decode steps replayed from CUDA graphs against the eager step (a batch of
    3: bucket 4; the hybrid's KV cache fixed-capacity and resident)."""
    from harness.models.decode_graphs import GraphedDecode

    worst, same = 0.0, True
    for attn in ([], [1]):
        model = _tiny_phi_mamba(attn, device)
        seqs = _probe_prompts()
        eager = _run_paths(model, seqs, 8, "auto", device)
        graphed = _run_paths(model, seqs, 8, "auto", device, graphs=GraphedDecode(model))
        worst = max(worst, *((a - b).abs().max().item() for a, b in zip(eager[1], graphed[1])))
        same &= eager[2] == graphed[2]
    return {"name": "phi-mamba and hybrid decode: CUDA graphs == eager", "max_diff": worst, "same_tokens": same,
            "ok": worst < TOL and same}


def memory_bandwidth(device) -> float:
    """Bytes per second a large device-to-device copy moves (read + write): the bound a decode step that
    reads every weight once cannot beat."""
    n = (256 if torch.device(device).type == "cuda" else 64) * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    sync = _synchronizer(device)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 10 * 2 * n * 4 / (time.perf_counter() - t0)


def check_vllm(tmp: Path) -> dict:
    """vLLM against the transformers backend: greedy tokens of a tiny random Llama."""
    from harness.backends.generation import GenRequest
    from harness.backends.hf import TransformersBackend
    from harness.backends.vllm_backend import VLLMBackend
    from harness.tiny import build_tokenizer, make_tiny_model

    path = str(make_tiny_model(tmp / "llama", "llama", tokenizer=build_tokenizer(), hidden=128))
    prompts = [f"Paragraph: Karvell\nKarvell is a town number {i}. Question: where?" for i in range(8)]
    hf = TransformersBackend(path, device="cuda", dtype="float32").generate([GenRequest(p, 16) for p in prompts])
    vl = VLLMBackend(path, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    got = vl.generate([GenRequest(p, 16) for p in prompts])
    same = sum(a.token_ids == b.token_ids for a, b in zip(hf, got))
    return {"name": "vllm == transformers (tiny llama, greedy)", "same": f"{same}/{len(prompts)}",
            "ok": same == len(prompts)}


def decode_table(device, size: str, lengths=(512, 2048, 8192), steps: int = 16, batches=(1,)) -> list[dict]:
    """Phi-Mamba and hybrid decode ms/token and state memory at 512 / 2k / 8k tokens, against Phi's KV cache
    (and both replayed from CUDA graphs on a GPU), each with the memory-bandwidth bound: measured copy bandwidth
    over the bytes a batch-1 step must read (every weight once, and the decoding state)."""
    from harness.engine.run import load_backend
    from harness.tiny import build_tokenizer, make_tiny_model

    hidden, layers = (2048, 24) if size == "real" else (128, 4)
    dtype = "bfloat16" if device == "cuda" else "float32"
    bandwidth = memory_bandwidth(device)
    family = ("phi-mamba", "hybrid-phi-mamba")
    runs = [(a, False) for a in (*family, "phi")] + ([(a, True) for a in family] if device == "cuda" else [])
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer()
        for arch, graphs in runs:
            path = make_tiny_model(f"{d}/{arch}", arch, tokenizer=tok, hidden=hidden, layers=layers,
                                   max_positions=max(lengths) + 64, init_std=0.02, real_heads=size == "real")
            backend = load_backend(str(path), device, dtype, cuda_graphs=graphs)
            weights = sum(p.numel() * p.element_size() for p in backend.model.parameters())
            for b in batches:
                for n in lengths:
                    try:
                        sec, nbytes = decode_cost(backend, n, steps, batch=b)
                    except torch.cuda.OutOfMemoryError:
                        rows.append({"model": arch + (" (graphs)" if graphs else ""), "batch": b, "context": n,
                                     "ms_per_step": "out of memory"})
                        torch.cuda.empty_cache()
                        continue
                    bound = b * bandwidth / (weights + nbytes)  # a step reads every weight once and every state
                    rows.append({"model": arch + (" (graphs)" if graphs else ""), **({"batch": b} if len(batches) > 1
                                                                                     else {}), "context": n,
                                 "ms_per_step": round(1e3 * sec, 3), "tokens_per_s": round(b / sec, 1),
                                 "bound_tokens_per_s": round(bound, 1), "of_bound": round(b / sec / bound, 3),
                                 "state_mib": round(nbytes / 2**20, 3)})
            del backend
            free_memory()
    return rows


def free_memory() -> None:
    """Give back what dropped models held: a backend's model, its graphs and its caches can hold each other in
    reference cycles that only the collector frees (on an H100, 61 GiB of earlier checks' models were still
    held when the decode table started)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- cli
def environment() -> dict:
    from harness.models import kernels

    env = {"python": platform.python_version(), **kernels.status()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return env


def paths(env: dict) -> dict:
    cuda = env["cuda_available"]
    return {
        "transformers backend": f"{'cuda, bfloat16' if cuda else 'cpu, float32'} (dtype auto)",
        "phi-mamba backend": f"{'cuda' if cuda else 'cpu'}, scan: {env['phi_mamba_scan']}",
        "vllm backend": "available" if (cuda and env["vllm"]) else "unavailable (needs vllm and a CUDA GPU)",
        "trainer mamba/hybrid": ("mamba-ssm + causal-conv1d CUDA kernels" if cuda and env["mamba_ssm"]
                                 and env["causal_conv1d"] else "transformers' PyTorch scan (slow on GPU)"),
    }


def _interpreted_kernel_check(cache: Path) -> dict:
    """The kernel check under Triton's CPU interpreter, in a child process (the interpreter must be switched
    on before triton is imported)."""
    from harness.tools.procs import python_result

    code = ("import json, sys\nfrom harness.models import kernels\n"
            f"kernels.enable_cpu_interpreter(kernels.fetch_mamba_ssm_sources({str(cache)!r}))\n"
            "from harness.doctor import check_phi_mamba_kernels\n"
            "print('RESULT ' + json.dumps(check_phi_mamba_kernels('cpu')))\n")
    out, res = python_result(code, timeout=1800, cwd=Path(__file__).resolve().parent.parent)
    if out is None:
        return {"name": "phi-mamba: mamba-ssm kernels == reference (cpu, triton interpreter)", "ok": False,
                "error": (res.stderr or res.stdout).strip()[-1500:]}
    out["name"] += ", triton interpreter"
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret-kernels", action="store_true",
                    help="on a CPU machine, run mamba-ssm's Triton kernels in Triton's interpreter against the "
                         "reference path (needs triton; fetches the mamba-ssm sdist once)")
    ap.add_argument("--cache", default=str(cache_dir()),
                    help="where fetched sources are kept (default: ~/.cache/icr-harness, or $ICR_CACHE)")
    ap.add_argument("--decode-size", choices=["tiny", "real"], default=None,
                    help="model size for the decode table (default: real on CUDA, tiny on CPU)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-speed table")
    ap.add_argument("--json", default=None, help="also write everything to this JSON file")
    ap.add_argument("--suite", choices=["gpu"], default=None,
                    help="gpu: every parity check, throughput, decode and trainer measurement in one run, written to "
                         "--out as report.json and report.md (released shapes on CUDA, tiny sizes on CPU)")
    ap.add_argument("--out", default="reports/gpu-suite", help="where --suite writes its report")
    ap.add_argument("--part", default="all",
                    help="the suite's parts, comma-separated: parity, throughput, decode, trainer, or all (default). "
                         "On an H100 each part fits one 10-minute call; all of them do not")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.suite == "gpu":
        from harness.tools.gpu_suite import PARTS, run_suite

        parts = PARTS if a.part == "all" else tuple(p.strip() for p in a.part.split(",") if p.strip())
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            print(f"error: --part {a.part!r}: unknown part {', '.join(unknown) or '(none given)'}; choose from "
                  f"{', '.join(PARTS)} or all", file=sys.stderr)
            return 2
        return run_suite(Path(a.out), parts=parts)

    env = environment()
    print("== environment")
    for k, v in env.items():
        print(f"  {k:18s} {v}")
    print("== paths")
    for k, v in paths(env).items():
        print(f"  {k:22s} {v}")

    checks = run_checks(env, a.interpret_kernels, Path(a.cache))
    table = [] if a.no_decode else print_decode_table(env, a.decode_size)
    if a.json:
        Path(a.json).write_text(json.dumps({"environment": env, "paths": paths(env), "checks": checks,
                                            "decode": table}, indent=2, default=str))
    failed = [c["name"] for c in checks if not c["ok"]]
    print(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


def run_checks(env: dict, interpret_kernels: bool, cache: Path) -> list[dict]:
    """The parity checks this machine can run, printed as they come; what it cannot is named as skipped."""
    checks = [check_phi_mamba_reference("cuda" if env["cuda_available"] else "cpu")]
    if env["cuda_available"] and env["phi_mamba_scan"] != "pytorch reference":
        checks.append(check_phi_mamba_kernels("cuda"))
    elif interpret_kernels:
        if not env["triton"]:
            checks.append({"name": "phi-mamba kernels under the interpreter", "ok": False,
                           "error": "triton is not installed: pip install triton"})
        else:
            checks.append(_interpreted_kernel_check(cache))
    if env["cuda_available"]:
        checks.append(check_cuda_graphs("cuda"))
    if env["cuda_available"] and env["vllm"]:
        with tempfile.TemporaryDirectory() as d:
            checks.append(check_vllm(Path(d)))
    print("== checks")
    for c in checks:
        detail = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("name", "ok"))
        print(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']}  ({detail})")
    skipped = []
    if not env["cuda_available"]:
        skipped.append("CUDA kernels, CUDA graphs and vLLM parity: no CUDA GPU here")
        if not interpret_kernels:
            skipped.append("kernels under the CPU interpreter: pass --interpret-kernels")
    for s in skipped:
        print(f"  SKIP  {s}")
    return checks


def print_decode_table(env: dict, size: str | None) -> list[dict]:
    device = "cuda" if env["cuda_available"] else "cpu"
    size = size or ("real" if device == "cuda" else "tiny")
    table = decode_table(device, size)
    print(f"== decode, batch 1, {size} random models on {device}")
    print(f"  {'model':26s} {'context':>8s} {'ms/step':>9s} {'tokens/s':>9s} {'bound/s':>9s} {'of bound':>9s} "
          f"{'state MiB':>10s}")
    for r in table:
        print(f"  {r['model']:26s} {r['context']:8d} {r['ms_per_step']:9.3f} {r['tokens_per_s']:9.1f} "
              f"{r['bound_tokens_per_s']:9.1f} {100 * r['of_bound']:8.1f}% {r['state_mib']:10.3f}")
    return table


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
