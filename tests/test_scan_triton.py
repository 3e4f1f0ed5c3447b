"""The Triton selective scan (``harness/ops/scan_triton.py``) in Triton's CPU interpreter, in a child process
(``TRITON_INTERPRET=1`` must be set before triton is imported): equal to the sequential scan in output and every
gradient over lengths around its chunk, with and without skip and gate, in the mixer's memory layouts; the
trainer's Mamba gives the same loss and gradients on it; and the check that guards its use on a GPU turns a
kernel that fails or differs into the PyTorch scan."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.ops import selective_scan as ss

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, os, warnings
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from harness.ops import scan_triton as st, selective_scan as ss
    from harness.models.istree import build_model
    from harness.training.step import masked_loss

    st.CHUNK = 8  # chunks of 8 steps: lengths below, at and past several chunks stay quick to interpret
    out = {"cases": []}

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-3)).item()  # a zero gradient must stay ~0

    for b, d, n, length, skip, gate, time_major in [(2, 20, 16, 19, True, True, True), (1, 3, 4, 1, False, False, False),
                                                  (2, 17, 5, 8, True, False, True), (1, 16, 16, 33, False, True, False),
                                                  (3, 5, 16, 7, True, True, False)]:
        g = torch.Generator().manual_seed(length)
        def mk(k, scale=1.0, shift=0.0):
            t = torch.randn(b, length, k, generator=g) if time_major else torch.randn(b, k, length, generator=g)
            t = t * scale + shift
            return t.transpose(1, 2) if time_major else t
        u, z = mk(d), mk(2 * d)[:, :d] if time_major else mk(d)  # z a strided slice, as in_proj's gate
        dt = mk(d, 0.03, 0.05).abs() + 1e-3
        B, C = mk(n), mk(n)
        A = -torch.rand(d, n, generator=g) * 4 - 0.5
        D = torch.randn(d, generator=g)
        w = torch.randn(b, d, length, generator=g)
        res = []
        for fn in (st.TritonScan.apply, ss.sequential_scan):
            ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C)]
            extra = [D.clone().requires_grad_() if skip else None, z.clone().requires_grad_() if gate else None]
            y = fn(*ins, *extra)
            leaves = ins + [t for t in extra if t is not None]
            res.append([y.detach(), *torch.autograd.grad((y * w).sum(), leaves)])
        out["cases"].append({"shape": [b, d, n, length, skip, gate, time_major], "varies": float(res[1][0].std()),
                             "nonzero_grads": sum(bool(t.abs().max() > 0) for t in res[1][1:]),
                             "worst": max(rel(a, r) for a, r in zip(*res))})

    # the trainer's Mamba on each scan: loss and every gradient
    ids = torch.randint(0, 30, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 21)
    grads = {}
    for choice in ("triton", "torch"):
        torch.manual_seed(0)
        model = build_model("mamba", "smoke", 30, scan=choice)
        loss = masked_loss(model(input_ids=ids).logits, ids, mask)
        loss.backward()
        grads[choice] = [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
    out["model_worst"] = max(rel(a, b) for a, b in zip(grads["triton"], grads["torch"]))
    out["model_grads"] = len(grads["torch"])

    # the guard: equal here; a kernel that differs, or fails, is refused with a warning
    out["verified"] = st.verified_on("cpu", ss.SelectiveScan)
    # the classes the trainer launches: bf16 activations (its autocast), without the gate or the skip
    out["verified_classes"] = [st.verified_on("cpu", ss.SelectiveScan, dtype, 16, skip, gate)
                               for dtype, skip, gate in (("bfloat16", True, True), ("float32", False, False))]
    right = st.TritonScan.apply
    for name, wrong in (("differs", lambda *a: right(*a) * 1.001), ("fails", lambda *a: 1 / 0)):
        st.TritonScan.apply = wrong
        st.verified_on.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = [st.verified_on("cpu", ss.SelectiveScan), " ".join(str(c.message) for c in caught)]
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_the_triton_scan_equals_the_sequential_one_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for case in out["cases"]:
        assert case["varies"] > 0 and case["nonzero_grads"] >= 4, case
        assert case["worst"] < 1e-5, case
    assert out["model_grads"] > 10 and out["model_worst"] < 1e-5, out
    assert out["verified"] is True and out["verified_classes"] == [True, True]
    assert out["differs"][0] is False and "differs from the PyTorch scan" in out["differs"][1]
    assert out["fails"][0] is False and "ZeroDivisionError" in out["fails"][1]


def test_the_scan_is_chosen_by_device_and_by_the_run(monkeypatch, caplog):
    cpu = ((1, 4, 3), torch.device("cpu"), torch.float32, 2)
    assert ss.choose_scan(*cpu).scan == "torch"  # a CPU runs the PyTorch scan by default
    assert ss.choose_scan(*cpu, "auto", fused=True).scan == "mamba-ssm"  # transformers' fused path where it runs
    assert ss.choose_scan(*cpu, "torch", fused=True).scan == "torch"  # only auto takes it
    assert ss.choose_scan(*cpu, "triton") == ss.ScanChoice("triton", "cpu", "float32", 2, checked=False)
    assert ss.choose_scan(*cpu, "sequential").scan == "sequential"
    with pytest.raises(ValueError, match="scan='fast'"):
        ss.choose_scan(*cpu, "fast")
    # the environment overrides a run's choice, and says so
    monkeypatch.delenv("ICR_SCAN", raising=False)
    assert ss.scan_override("torch") == "torch"
    monkeypatch.setenv("ICR_SCAN", "sequential")
    with caplog.at_level("WARNING", logger="harness"):
        assert ss.scan_override("auto") == "sequential"
    assert "ICR_SCAN=sequential overrides --scan auto" in caplog.text


AOT = textwrap.dedent("""
    import inspect, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from harness.ops import scan_triton as st

    POINTERS = {"u", "dt", "z", "Bm", "Cm", "A", "D", "dout", "state", "dtsum", "y", "ends", "starts", "g_in",
                "scratch", "du", "ddt", "dz", "dB_part", "dC_part", "dA_part", "dD_part"}
    BF16 = {"u", "z", "Bm", "Cm"}  # the mixer's activations under bf16 autocast

    def build(kernel, constexprs, arch):
        params = list(inspect.signature(kernel.fn).parameters)
        signature = {p: "constexpr" if p in constexprs else ("*bf16" if p in BF16 else "*fp32") if p in POINTERS
                     else "i32" for p in params}
        src = ASTSource(kernel, signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
        return triton.compile(src, target=GPUTarget("cuda", arch, 32))

    built = 0
    for arch in (80, 90):  # A100, H100/H200
        for flags in (dict(HAS_D=True, HAS_Z=True), dict(HAS_D=False, HAS_Z=False)):
            tile = dict(K=st.CHUNK, BD=st.BLOCK_D, BN=16)
            for mode in (0, 1, 2):
                built += bool(build(st._chunk_scan, dict(MODE=mode, **flags, **tile), arch).asm["cubin"])
            built += bool(build(st._chunk_backward, dict(**flags, **tile), arch).asm["cubin"])
        for reverse in (False, True):
            built += bool(build(st._carry, dict(REVERSE=reverse, BD=st.BLOCK_D, BN=16), arch).asm["cubin"])
    print(built)
""")


@pytest.mark.slow
def test_the_kernels_compile_for_nvidia_gpus_without_one(tmp_path):
    """Every kernel variant compiled ahead of time to a cubin for sm_80 and sm_90 by Triton's own NVIDIA backend
    (its bundled ptxas): a kernel that the interpreter runs but a GPU's compiler rejects fails here, on CPU."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", AOT], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.strip().splitlines()[-1]) == 2 * (2 * 4 + 2)
