"""Decode attention over the filled positions (harness.ops.decode_attention): the Triton split-KV kernels in
Triton's CPU interpreter against SDPA over the whole capacity (rows of other lengths, grouped heads, a head size
that is no power of two, several splits, NaN past the filled part: read, it would show), and the graphed decode
attending through them, greedy tokens equal to eager decoding. A filled attention that parts from SDPA's is
turned off for the run, the reason said, the tokens still eager's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from harness.backends.base import GenRequest
from harness.ops.decode_attention import reference_attention

ROOT = Path(__file__).resolve().parents[1]


def _case(b, h, hk, d, capacity, last, dtype, seed=0):
    """q, k, v, the additive mask (row 0 left-padded) and the SDPA over the capacity, then NaN past ``last``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hk, capacity, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(b, 1, 1, capacity, dtype=dtype)
    mask[0, ..., : min(7, last)] = torch.finfo(dtype).min
    mask[..., last + 1:] = torch.finfo(dtype).min
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(),
                                                            enable_gqa=hk != h)
    k[..., last + 1:, :] = float("nan")
    v[..., last + 1:, :] = float("nan")
    return q, k, v, mask, torch.tensor([last]), want


def test_the_reference_attends_over_the_filled_positions_as_sdpa_over_the_capacity():
    q, k, v, mask, last, want = _case(3, 4, 2, 16, 300, 211, torch.float32)
    got = reference_attention(q, k, v, mask, last, 16 ** -0.5)
    assert not torch.equal(got[0], got[1]) and torch.allclose(got, want, atol=1e-6)


@pytest.mark.slow
def test_the_triton_kernels_equal_sdpa_and_the_graphed_decode_through_them_equals_eager(tmp_path):
    script = textwrap.dedent("""
        import json, os, sys, warnings
        os.environ["TRITON_INTERPRET"] = "1"
        warnings.simplefilter("ignore")
        import torch
        sys.path.insert(0, sys.argv[1])
        from tests.test_decode_attention import _case, _greedy
        from harness.ops import decode_attention as da
        launches = [0]
        kernel = da.filled_attention
        def counted(*args):
            launches[0] += 1
            return kernel(*args)
        da.filled_attention = counted
        worst = {}
        # (rows, heads, kv heads, head size, capacity, last filled index, dtype): one split and several (one
        # empty), grouped heads, a head size padded to 128, half precision rounded as a GPU stores it
        for case in [(2, 4, 4, 64, 700, 600, torch.float32), (3, 8, 2, 80, 130, 70, torch.float32),
                     (1, 2, 1, 16, 1600, 1030, torch.float32), (2, 4, 4, 64, 200, 199, torch.bfloat16)]:
            q, k, v, mask, last, want = _case(*case)
            # keys and values as the graphs hand them over: views of larger buffers
            k, v = (torch.cat([t, t], 0)[: t.shape[0]] for t in (k, v))
            got = da.attention_op(q, k, v, mask, last, case[3] ** -0.5)
            assert got.dtype == case[-1] and not torch.equal(got[:, 0], got[:, 1])
            diff = ((got.float() - want).abs().max() / want.abs().max()).item()
            diff = diff if diff == diff else float("inf")  # NaN (a position past the filled part read) fails
            worst[str(case[-1])] = max(worst.get(str(case[-1]), 0.0), diff)
        assert launches[0] == 4, launches
        same, described = _greedy(sys.argv[2])
        print("RESULT " + json.dumps({"worst": worst, "launches": launches[0], "same": same, "described": described}))
        """)
    res = subprocess.run([sys.executable, "-c", script, str(ROOT), str(tmp_path)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    worst = got["worst"]
    assert worst["torch.float32"] < 1e-5 and worst["torch.bfloat16"] < 1e-2, worst  # bf16: an output ulp
    # the graphed decode launched the kernels (beyond the four above) and gave eager's tokens
    assert got["launches"] > 4 and got["same"] and got["described"].endswith("filled positions (split-KV)"), got


def _greedy(where: str, arch: str = "phi", wrong=None):
    """Greedy tokens of a tiny ``arch`` model eagerly and through graphs (capture off) attending over the filled
    positions, prompts of three lengths (the capacity past the longest); whether they are equal (and vary), and
    what the graphs say of themselves. ``wrong``: an operator put in place of the filled attention."""
    from harness.backends import kv_decode_graphs as kv
    from harness.backends.loading import load_backend
    from harness.tiny import build_tokenizer, make_tiny_model

    path = make_tiny_model(Path(where) / arch, arch, tokenizer=build_tokenizer(), init_std=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = load_backend(str(path), device="cpu", dtype="float32")
    texts = [f"Paragraph {i}: {'the river Karvell runs north ' * (1 + 4 * i)}Question: where is it?"
             for i in range(3)]

    def run():
        reqs = [GenRequest(t, 6 + 3 * i) for i, t in enumerate(texts)]
        return [r.token_ids for r in backend.generate(reqs, batch_size=3, prefix_reuse="none")]

    eager = run()
    backend.graphs = kv.GraphedKVDecode(backend.model, capture=False, attention="filled")
    if wrong is not None:
        kv.attention_op, right = wrong, kv.attention_op
    try:
        graphed = run()
    finally:
        if wrong is not None:
            kv.attention_op = right
    assert backend.graphs.cache.graphs and backend.graphs.buffers.capacity > max(len(t) for t in eager)
    return graphed == eager and len({tuple(t) for t in eager}) == 3, backend.graphs.describe()


def test_a_filled_attention_that_parts_from_sdpa_is_turned_off_and_says_why(tmp_path, caplog):
    """The gate at a graph's first step: an attention whose output is wrong (here every value's mean) is refused,
    the run decodes on over the capacity, tokens still eager's."""
    def wrong(q, k, v, mask, last, scale):
        return v[:, :1].mean(2, keepdim=True).expand(q.shape).contiguous()

    same, described = _greedy(str(tmp_path), "llama", wrong=wrong)
    assert same and "attention over the capacity (it parted from SDPA over the capacity at 4 rows" in described
    assert "filled positions' attention is off for the rest of this run" in caplog.text
    same, described = _greedy(str(tmp_path / "right"), "llama")  # the real one, through the reference on a CPU
    assert same and described.endswith("attention over the filled positions (split-KV)")


def test_the_gpu_suites_filled_rows_run_on_cpu():
    """What the quick suite runs on a GPU (the parity check, then Phi's decode timed through graphs attending
    over the filled positions), run here with capture off: ok, one Phi row, none for Phi-Mamba (its own graphs)."""
    from harness.tools.checks import check_cuda_graphs, decode_rows

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check = check_cuda_graphs("cpu", attention="filled")
        rows = list(decode_rows("cpu", "tiny", (64,), 2, (1,), archs=("phi", "phi-mamba"), modes=("filled",)))
    assert check["ok"] and check["same_tokens"] and "filled positions" in check["name"], check
    assert [r["model"] for r in rows] == ["phi (graphs, filled attention)"] and rows[0]["ms_per_step"] > 0, rows
