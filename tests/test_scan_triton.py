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
    import contextlib, json, os, warnings
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime import interpreter
    from harness.ops import conv_triton as ct, scan_triton as st, selective_scan as ss
    from harness.ops.causal_conv import CausalConv
    from harness.models.istree import build_model, scans_ran
    from harness.tools.bench import AllocatedBytes
    from harness.training.step import masked_loss

    # every scan on chunks of 8 steps (lengths below, at and past several chunks stay quick to interpret) and blocks
    # of 16 channels (the cases below cross blocks)
    st.TILES = ((None, ("chunks", 8, 16, 4, 1)),)
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
            with AllocatedBytes() as counted:  # the backward alone (dL/dy = w)
                grads = torch.autograd.grad(y, leaves, w)
            res.append([y.detach(), *grads])
            if not res[1:]:  # the Triton scan's
                backward_bytes = counted.bytes
                gradient_bytes = sum(t.numel() * t.element_size() for t in grads)
        out["cases"].append({"shape": [b, d, n, length, skip, gate, time_major], "varies": float(res[1][0].std()),
                             "nonzero_grads": sum(bool(t.abs().max() > 0) for t in res[1][1:]),
                             "worst": max(rel(a, r) for a, r in zip(*res)),
                             "backward_bytes": backward_bytes, "gradient_bytes": gradient_bytes})

    # packed rows: the scan restarts at each sample's first token (at a chunk's first step, mid-chunk, twice in a
    # row, at the last step), as the step-by-step scan does
    g = torch.Generator().manual_seed(7)
    b, d, n, length = 2, 20, 4, 27
    u, z, B, C, w = (torch.randn(*shape, generator=g) for shape in [(b, d, length), (b, d, length), (b, n, length),
                                                                   (b, n, length), (b, d, length)])
    dt, A, D = torch.rand(b, d, length, generator=g) * 0.3, -torch.rand(d, n, generator=g) * 2, torch.randn(d)
    starts = torch.zeros(b, length)
    starts[:, [0, 8, 11, 12, length - 1]] = 1
    res = []
    for fn in (st.TritonScan.apply, ss.sequential_scan):
        ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z)]
        y = fn(*ins, starts=starts) if fn is ss.sequential_scan else fn(*ins, starts)
        res.append([y.detach(), *torch.autograd.grad(y, ins, w)])
    out["resets"] = {"worst": max(rel(a, r) for a, r in zip(*res)),
                     "restarted": rel(st.TritonScan.apply(u, dt, A, B, C, D, z), res[0][0])}

    # the step-by-step layout (scan_triton_steps): the same contract, with and without restarts, D and z
    out["steps"] = []
    for b, d, n, length, skip, gate, restarts in [(2, 9, 16, 19, True, True, False), (2, 5, 4, 27, True, True, True),
                                                  (1, 3, 5, 11, False, False, True)]:
        g = torch.Generator().manual_seed(length + d)
        u, z = torch.randn(b, length, d, generator=g).transpose(1, 2), torch.randn(b, d, length, generator=g)
        dt = torch.rand(b, d, length, generator=g) * 0.3 + 1e-3
        B, C, w = torch.randn(b, n, length, generator=g), torch.randn(b, n, length, generator=g), torch.randn(b, d, length)
        A, D = -torch.rand(d, n, generator=g) * 2 - 0.5, torch.randn(d, generator=g)
        starts = None
        if restarts:
            starts = torch.zeros(b, length)
            starts[:, [0, 3, 8, 9, length - 1]] = 1
        res = []
        for fn in ("triton", "sequential"):
            ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C)]
            extra = [D.clone().requires_grad_() if skip else None, z.clone().requires_grad_() if gate else None]
            with st.tiled("steps", 8, 4, 1):
                y = (st.TritonScan.apply(*ins, *extra, starts) if fn == "triton"
                     else ss.sequential_scan(*ins, *extra, starts=starts))
                leaves = ins + [t for t in extra if t is not None]
                res.append([y.detach(), *torch.autograd.grad(y, leaves, w)])
        out["steps"].append({"varies": float(res[1][0].std()), "worst": max(rel(a, r) for a, r in zip(*res))})
    with st.tiled("steps", 8, 4, 1):
        out["steps_verified"] = st.verified_on("cpu", ss.SelectiveScan, "float32", 16, True, True, True,
                                               st.current_tile(1))

    # the interpreter made faster (harness.ops.interpreter: the vectorised scan, helpers patched once a launch)
    # gives the stock interpreter's bits, on both scan layouts (kernels that call @triton.jit helpers)
    fast = [(interpreter.ScanOps, "generic_scan"), (interpreter.InterpretedFunction, "__call__"),
            (interpreter.GridExecutor, "__call__")]
    patched = [getattr(owner, name) for owner, name in fast]
    assert all(hasattr(f, "stock") for f in patched)
    runs = []
    for which in (patched, [f.stock for f in patched]):
        for (owner, name), f in zip(fast, which):
            setattr(owner, name, f)
        for layout in (None, ("steps", 8, 4, 1)):
            ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z)]
            with st.tiled(*layout) if layout else contextlib.nullcontext():
                y = st.TritonScan.apply(*ins)
            runs.append([y, *torch.autograd.grad(y, ins, w)])
    for (owner, name), f in zip(fast, patched):
        setattr(owner, name, f)
    out["bitwise"] = all(torch.equal(a, b) for r in range(2) for a, b in zip(runs[r], runs[r + 2])) \
        and bool(runs[0][0].std() > 0)

    # time cut in splits run side by side (both layouts): equal to the sequential scan, 3 splits of 2, 2 and 1
    # chunks, a restart on the second's first step and none on the third's; the side passes ran with their grids
    launched, side_passes = [], {name: getattr(st, name) for name in ("_split_ends_forward", "_split_ends_backward")}
    for name, kernel in side_passes.items():
        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launched.append((name, grid[2]))
                return kernel[grid]
        setattr(st, name, Counted())
    g = torch.Generator().manual_seed(11)
    b, d, n, length = 2, 5, 3, 37  # 5 chunks of 8, the last short; 2 blocks of 4 channels, the last short
    u, z = torch.randn(b, length, d, generator=g).transpose(1, 2), torch.randn(b, d, length, generator=g)
    dt = torch.rand(b, d, length, generator=g) * 0.3 + 1e-3
    B, C, w = torch.randn(b, n, length, generator=g), torch.randn(b, n, length, generator=g), torch.randn(b, d, length)
    A, D = -torch.rand(d, n, generator=g) * 2 - 0.5, torch.randn(d, generator=g)
    packed = torch.zeros(b, length)
    packed[:, [0, 3, 16, 17, length - 1]] = 1  # 16: the second split's first step (32: the third's, no restart)
    out["splits"] = []
    ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z)]
    y = ss.sequential_scan(*ins[:5], ins[5], ins[6], starts=packed)
    ref = [y.detach(), *torch.autograd.grad(y, ins, w)]
    for layout in (("chunks", 8, 4, 1, 3), ("steps", 8, 4, 1, 3)):
        ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z)]
        with st.tiled(*layout):
            y = st.TritonScan.apply(*ins, packed)
            got = [y.detach(), *torch.autograd.grad(y, ins, w)]
        out["splits"].append({"layout": layout[0], "varies": float(ref[0].std()),
                              "worst": max(rel(a, r) for a, r in zip(got, ref))})
    out["split_grids"] = sorted(set(launched))
    for name, kernel in side_passes.items():
        setattr(st, name, kernel)

    # the causal convolution against CausalConv: strided input, with and without a bias, 4 and 2 taps, one step;
    # packed rows (restarts at the first step, inside a block, at a block's edge, twice in a row, at the last step)
    out["conv"] = []
    packed = torch.zeros(2, 37)
    packed[:, [0, 3, 31, 32, 33, 36]] = 1
    for b, length, c, taps, bias, starts in [(2, 37, 67, 4, True, None), (1, 1, 3, 4, True, None),
                                             (2, 5, 9, 2, False, None), (2, 37, 67, 4, True, packed),
                                             (2, 37, 9, 2, False, packed)]:
        g = torch.Generator().manual_seed(c)
        wide = torch.randn(b, length, 2 * c, generator=g)
        weight, bb = torch.randn(c, taps, generator=g), torch.randn(c, generator=g)
        dy = torch.randn(b, length, c, generator=g)
        res = []
        for conv in (ct.TritonCausalConv, CausalConv):
            leaves = [t.clone().requires_grad_() for t in ((wide, weight, bb) if bias else (wide, weight))]
            y = conv.apply(leaves[0][..., :c], leaves[1], leaves[2] if bias else None, starts)
            res.append([y.detach(), *torch.autograd.grad(y, leaves, dy)])
        unpacked = CausalConv.apply(wide[..., :c], weight, bb if bias else None)
        out["conv"].append({"varies": float(res[1][0].std()), "worst": max(rel(a, r) for a, r in zip(*res)),
                            "restarted": rel(res[0][0], unpacked) if starts is not None else None})

    # the trainer's Mamba on each scan (Triton: its scan and its convolution): loss and every gradient
    ids = torch.randint(0, 30, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 21)
    grads = {}
    st.TILES = ((None, ("chunks", 8, 64, 4, 1)),)  # one block per layer: quicker to interpret
    for choice in ("triton", "torch"):
        torch.manual_seed(0)
        model = build_model("mamba", "smoke", 30, scan=choice)
        loss = masked_loss(model(input_ids=ids).logits, ids, mask)
        loss.backward()
        grads[choice] = [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        out[f"{choice}_ran"] = scans_ran(model)
    st.TILES = ((None, ("chunks", 8, 16, 4, 1)),)
    out["model_worst"] = max(rel(a, b) for a, b in zip(grads["triton"], grads["torch"]))
    out["model_grads"] = len(grads["torch"])

    # the guards: equal here; a kernel that differs, or fails, is refused with a warning
    out["verified"] = [st.verified_on("cpu", ss.SelectiveScan), ct.verified_on("cpu", CausalConv)]
    # the classes the trainer launches: bf16 activations (its autocast), without the gate or the skip
    out["verified_classes"] = [st.verified_on("cpu", ss.SelectiveScan, dtype, 16, skip, gate)
                               for dtype, skip, gate in (("bfloat16", True, True), ("float32", False, False))]
    out["verified_classes"].append(ct.verified_on("cpu", CausalConv, "bfloat16"))
    out["verified_classes"].append(st.verified_on("cpu", ss.SelectiveScan, "float32", 16, True, True, True))
    out["verified_classes"].append(ct.verified_on("cpu", CausalConv, "bfloat16", resets=True))
    for module, fn, check in ((st, "TritonScan", lambda: st.verified_on("cpu", ss.SelectiveScan)),
                              (ct, "TritonCausalConv", lambda: ct.verified_on("cpu", CausalConv))):
        right = getattr(module, fn)
        for name, wrong in (("differs", lambda *a: right.apply(*a) * 1.001), ("fails", lambda *a: 1 / 0)):
            setattr(module, fn, type(fn, (), {"apply": staticmethod(wrong)}))
            module.verified_on.cache_clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out[f"{fn} {name}"] = [check(), " ".join(str(c.message) for c in caught)]
        setattr(module, fn, right)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_the_triton_scan_and_convolution_equal_the_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for case in out["cases"]:
        assert case["varies"] > 0 and case["nonzero_grads"] >= 4, case
        assert case["worst"] < 1e-5, case
        # nothing the size of steps x channels x states: the backward allocates its gradients and the partial
        # sums of dB and dC per block of channels (a state history in memory was 6-10x the gradients here)
        assert case["backward_bytes"] <= 2 * case["gradient_bytes"], case
    assert out["resets"]["worst"] < 1e-5 and out["resets"]["restarted"] > 1e-2, out["resets"]
    for case in out["steps"]:
        assert case["varies"] > 0 and case["worst"] < 1e-5, case
    assert out["steps_verified"] is True
    for case in out["splits"]:
        assert case["varies"] > 0 and case["worst"] < 1e-5, case
    # the side passes' third grid axis: splits - 1
    assert out["split_grids"] == [["_split_ends_backward", 2], ["_split_ends_forward", 2]], out["split_grids"]
    assert out["bitwise"] is True
    for case in out["conv"]:
        assert case["varies"] > 0 and case["worst"] < 1e-5, case
        assert case["restarted"] is None or case["restarted"] > 1e-2, case  # the restarts changed the numbers
    assert out["model_grads"] > 10 and out["model_worst"] < 1e-5, out
    assert {(r["scan"], r["conv"]) for r in out["triton_ran"]} == {("triton", "triton")}, out
    assert out["verified"] == [True, True] and out["verified_classes"] == [True] * 5
    for fn, what in (("TritonScan", "PyTorch scan"), ("TritonCausalConv", "PyTorch one")):
        assert out[f"{fn} differs"][0] is False and f"differs from the {what}" in out[f"{fn} differs"][1]
        assert out[f"{fn} fails"][0] is False and "ZeroDivisionError" in out[f"{fn} fails"][1]


BF16_CHILD = textwrap.dedent("""
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    from harness.ops import kernels, selective_scan as ss
    from tests.helpers import bf16_errors_against_float64
    with kernels.carried_sources():
        from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

    def triton(*args, **kwargs):
        return ss.selective_scan(*args, **kwargs, scan="triton")

    print(json.dumps(bf16_errors_against_float64(triton, selective_scan_ref)))
""")


@pytest.mark.slow
def test_the_triton_scan_keeps_bf16_gradients_near_mamba_ssms_reference():
    """The check ``tests/test_selective_scan.py`` holds the PyTorch scan to, on the Triton scan: bf16 activations,
    output and every gradient within 1.3x of mamba-ssm's reference scan's error against float64."""
    from harness.cache import cache_dir
    from harness.ops import kernels

    try:
        src = kernels.fetch_mamba_ssm_sources(cache_dir())
    except OSError as e:
        pytest.skip(f"mamba-ssm sources: {e}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "ICR_MAMBA_SSM_SRC": str(src)}
    res = subprocess.run([sys.executable, "-c", BF16_CHILD], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {}


def test_a_scan_whose_indices_pass_32_bits_on_its_tile_is_refused_before_it_launches():
    """``fits`` counts what each tile adds: the step-by-step backward's scratch grows with the splits (a program
    each), the chunked layout's only by the splits' states; ``splits_of`` never leaves a split empty."""
    from harness.ops import scan_triton as st

    shape = (256, 256, 2535)  # 159 chunks of 16
    assert st.splits_of(159, 1000) == (1, 159) and st.splits_of(159, 8) == (20, 8) and st.splits_of(3, 2) == (2, 2)
    for chunk, block, splits in ((8, 4, 1), (64, 4, 3), (16, 16, 8)):  # the device check runs every split it has
        b, d, length = st.check_shape(("chunks", chunk, block, 1, splits))
        assert st.splits_of(-(-length // chunk), splits) == (2, splits) and length % chunk and d % block
    assert st.fits(shape, 16, ("steps", 16, 16, 1, 1)) and st.fits(shape, 16, ("steps", 16, 16, 1, 8))
    assert not st.fits(shape, 16, ("steps", 16, 16, 1, 1000))  # 256 x 159 x 16 x 256 x 16 > 2**31
    assert st.fits(shape, 16, ("chunks", 16, 16, 1, 1000))
    assert not st.fits((2**16, 256, 2535), 16, ("chunks", 64, 4, 1, 1))  # the inputs alone
    with pytest.raises(ValueError, match="indexes in 32 bits"):
        st._grid(torch.empty(256, 256, 2535, device="meta"), 16, ("steps", 16, 16, 1, 1000))


def test_the_scan_is_chosen_by_device_and_by_the_run(monkeypatch, caplog):
    from harness.ops import scan_triton as st

    cpu = ((1, 4, 3), torch.device("cpu"), torch.float32, 2)
    assert ss.choose_scan(*cpu).scan == "torch"  # a CPU runs the PyTorch scan by default
    assert ss.choose_scan(*cpu, "auto", fused=True).scan == "mamba-ssm"  # transformers' fused path where it runs
    assert ss.choose_scan(*cpu, "torch", fused=True).scan == "torch"  # only auto takes it
    # forced: both kernels, on the table's tile (a CPU times no tiles)
    assert ss.choose_scan(*cpu, "triton") == ss.ScanChoice("triton", "cpu", "float32", 2, checked=False,
                                                           conv="triton", tile=st.current_tile(4))
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
    from harness.ops import conv_triton as ct, scan_triton as st

    from harness.ops import scan_triton_steps as steps

    POINTERS = {"u", "dt", "z", "Bm", "Cm", "A", "D", "resets", "dout", "y", "starts", "du", "ddt", "dz", "dB_part",
                "dC_part", "dA_part", "dD_part", "x", "w", "bias", "dy", "dx", "dw_part", "db_part", "since", "scratch",
                "ends", "decays", "carries"}
    BF16 = {"u", "z", "Bm", "Cm", "du", "dz", "x", "dx"}  # the mixer's activations under bf16 autocast

    def build(kernel, constexprs, arch):
        params = list(inspect.signature(kernel.fn).parameters)
        signature = {p: "constexpr" if p in constexprs else ("*bf16" if p in BF16 else "*i32" if p == "since" else
                                                             "*fp32") if p in POINTERS else "i32" for p in params}
        src = ASTSource(kernel, signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
        return triton.compile(src, target=GPUTarget("cuda", arch, 32))

    # each layout at the tile scan_triton.TILES gives it (a layout the table no longer picks: a tile it did)
    LAYOUTS = {"chunks": ("chunks", 32, 16, 4), "steps": ("steps", 32, 4, 1), **{t[0]: t for _, t in st.TILES}}
    built = 0
    for arch in (80, 90):  # A100, H100/H200
        for flags in (dict(HAS_D=True, HAS_Z=True, HAS_RESETS=True), dict(HAS_D=False, HAS_Z=False, HAS_RESETS=False)):
            tile = dict(K=LAYOUTS["chunks"][1], BD=LAYOUTS["chunks"][2], BN=16)
            for kernel in (st._scan_forward, st._scan_backward):
                built += bool(build(kernel, dict(**flags, **tile), arch).asm["cubin"])
        if arch == 90:  # the step-by-step layout, every flag on (sm_90 only: its compile is the slow one)
            for kernel in (steps._steps_forward, steps._steps_backward):
                flags = dict(HAS_D=True, HAS_Z=True, HAS_RESETS=True, K=LAYOUTS["steps"][1], BD=LAYOUTS["steps"][2],
                             BN=16)
                built += bool(build(kernel, flags, arch).asm["cubin"])
            # the splits' side passes, every flag on, at the chunked layout's tile
            for kernel, flags in ((steps._split_ends_forward, dict(HAS_RESETS=True)),
                                  (steps._split_ends_backward, dict(HAS_Z=True, HAS_RESETS=True))):
                flags.update(K=LAYOUTS["chunks"][1], BD=LAYOUTS["chunks"][2], BN=16)
                built += bool(build(kernel, flags, arch).asm["cubin"])
        for bias in (True, False):  # packed rows' restarts with the bias, not without
            for kernel in (ct._conv_forward, ct._conv_backward):
                built += bool(build(kernel, dict(HAS_BIAS=bias, HAS_SINCE=bias, K=4, BT=ct.BLOCK_T, BC=ct.BLOCK_C),
                                    arch).asm["cubin"])
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
    assert int(res.stdout.strip().splitlines()[-1]) == 2 * (2 * 2 + 2 * 2) + 2 + 2
