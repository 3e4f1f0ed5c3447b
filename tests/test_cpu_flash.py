"""The CPU flash attention kernel (``harness/ops/cpu_flash.py``), compiled here for real: against SDPA in float64
over the masks it meets (pads, grouped heads, cached keys, SDPA's causal flag), the same to the bit whatever the
thread count and whether a row runs alone or in a batch, taken by the models' forwards with the same tokens as
transformers' ``generate``, and left out, saying why, where it cannot be built or does not agree."""
import json
import logging
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from harness.backends import chunked_attention
from harness.backends.additive_mask import BuiltMask, additive_mask
from harness.ops import cpu_flash
from tests.helpers import assert_varied, long_front_prompts, spy, sweep_prompts


def _case(rows, heads, kv_heads, queries, past, dim, pads, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = past + queries
    query = 3 * torch.randn(rows, heads, queries, dim, generator=g)  # peaked weights: outputs that vary
    key, value = (torch.randn(rows, kv_heads, keys, dim, generator=g) for _ in range(2))
    seen = torch.ones(rows, keys, dtype=torch.long)
    for row, (lo, hi) in pads.items():
        seen[row, lo:hi] = 0
    return query, key, value, seen


def _reference(query, key, value, mask, scale, dtype=torch.float64):
    group = query.shape[1] // key.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).to(dtype) for x in (key, value))
    return F.scaled_dot_product_attention(query.to(dtype), k, v, attn_mask=mask.to(dtype), scale=scale).transpose(1, 2)


@pytest.mark.parametrize("dim", [16, 64, 80, 128])
@pytest.mark.parametrize("rows,heads,kv_heads,queries,past,pads", [
    (1, 4, 4, 37, 0, {}),                       # a whole prompt, as SDPA's causal flag takes it
    (2, 4, 2, 300, 41, {1: (0, 60)}),          # grouped heads, a left-padded row, keys cached before the block
    (3, 2, 1, 17, 700, {0: (0, 5), 2: (300, 340)}),  # one key head, pads at the front and in the middle
    (2, 4, 4, 270, 530, {1: (790, 800)}),      # the second row's block ends in pads (right padding)
    (1, 2, 2, 100, 1500, {0: (800, 840)}),     # keys over three of the kernel's blocks, pads in the second
])
def test_the_kernel_equals_sdpa_in_float64_as_closely_as_sdpa_in_float32(dim, rows, heads, kv_heads, queries, past,
                                                                         pads):
    assert cpu_flash.available(dim)
    query, key, value, seen = _case(rows, heads, kv_heads, queries, past, dim, pads)
    mask = additive_mask(seen, queries, torch.float32)
    scale = dim ** -0.5
    if mask.dim() == 2:  # no pads, as many queries as keys: transformers passes no mask, SDPA is causal
        ours = cpu_flash.attention(query, key, value, None, [[]] * rows, scale)
    else:
        built = BuiltMask(mask, seen)
        ours = cpu_flash.attention(query, key, value, mask, [built.pad_runs(r) for r in range(rows)], scale)
    causal = seen.bool()[:, None, None, :] & torch.ones(queries, past + queries, dtype=torch.bool).tril(past)
    mask = torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    exact, theirs = _reference(query, key, value, mask, scale), _reference(query, key, value, mask, scale,
                                                                           torch.float32)
    real = seen[:, past:].bool()  # a pad's own query sees no real key: its output is never read
    assert exact[real].std() > 0.1  # the outputs vary
    errors = [float((x.double() - exact)[real].abs().max()) for x in (ours, theirs)]
    assert errors[0] < 4 * errors[1] + 1e-6, errors
    assert torch.isfinite(ours).all()  # pads' own queries included


@pytest.mark.parametrize("dim", [16, 64, 80, 128])
@pytest.mark.parametrize("rows,heads,kv_heads,queries,shared", [
    (1, 4, 4, 1, 0),      # one row's decoding step, no mask
    (5, 4, 2, 1, 200),    # five merged rows behind a shared front, pads after it, grouped heads
    (3, 2, 1, 7, 37),     # a short block a row (a tool's result fed back), one key head
    (4, 4, 4, 16, 0),     # the most queries the pass takes, no shared front
])
def test_the_decoding_pass_equals_sdpa_in_float64_with_a_front_read_from_the_first_row(dim, rows, heads, kv_heads,
                                                                                       queries, shared):
    g = torch.Generator().manual_seed(dim + queries)
    keys = 300 + queries
    query = 3 * torch.randn(rows, heads, queries, dim, generator=g)
    key, value = (torch.randn(rows, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = None
    if queries > 1 or rows > 1:  # pads after the front, a causal block at the end
        seen = torch.ones(rows, keys, dtype=torch.long)
        for row in range(1, rows):
            seen[row, shared:shared + 11 * row] = 0
        mask = additive_mask(seen, queries, torch.float32)
    for x in (key, value):  # what the pass reads of other rows' fronts must not matter: they differ here
        x[1:, :, :shared] = torch.randn(rows - 1, kv_heads, shared, dim, generator=g) if rows > 1 else x[1:, :, :shared]
    ours = cpu_flash.decode(query, key, value, mask, shared, dim ** -0.5)
    front = key.clone(), value.clone()
    for x in front:
        x[:, :, :shared] = x[:1, :, :shared]
    full = mask if mask is not None else torch.zeros(rows, 1, queries, keys)
    exact, theirs = (_reference(query, *front, full, dim ** -0.5, dtype) for dtype in (torch.float64, torch.float32))
    assert exact.std() > 0.1
    errors = [float((x.double() - exact).abs().max()) for x in (ours, theirs)]
    assert errors[0] < 4 * errors[1] + 1e-6, errors
    if mask is not None:  # keys the mask hides with the dtype's minimum are skipped, to the bit: read, they weigh 0
        read = mask.clamp(min=-1e30)
        assert (read != mask).any()
        assert torch.equal(ours, cpu_flash.decode(query, key, value, read, shared, dim ** -0.5))


def test_a_row_is_the_same_to_the_bit_alone_or_batched_and_with_one_thread_or_two():
    query, key, value, seen = _case(3, 4, 2, 200, 300, 64, {1: (0, 30)}, seed=1)
    mask = additive_mask(seen, 200, torch.float32)
    built = BuiltMask(mask, seen)
    pads = [built.pad_runs(r) for r in range(3)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = cpu_flash.attention(query, key, value, mask, pads, 0.125)
        torch.set_num_threads(1)
        single = cpu_flash.attention(query, key, value, mask, pads, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(batched[0], batched[2])
    assert torch.equal(batched, single)
    for row in range(3):
        alone = cpu_flash.attention(query[row:row + 1], key[row:row + 1], value[row:row + 1], mask[row:row + 1],
                                    pads[row:row + 1], 0.125)
        assert torch.equal(alone[0], batched[row])
    step = query[:, :, -1:], mask[:, :, -1:]  # the decoding pass likewise
    try:
        torch.set_num_threads(1)
        single = cpu_flash.decode(step[0], key, value, step[1], 0, 0.125)
    finally:
        torch.set_num_threads(threads)
    batched = cpu_flash.decode(step[0], key, value, step[1], 0, 0.125)
    assert not torch.equal(batched[0], batched[2]) and torch.equal(batched, single)
    for row in range(3):
        alone = cpu_flash.decode(step[0][row:row + 1], key[row:row + 1], value[row:row + 1], step[1][row:row + 1], 0,
                                 0.125)
        assert torch.equal(alone[0], batched[row])


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_the_models_attend_through_it_and_write_transformers_generate_s_tokens(which, request):
    """Padded batches, prefix-tree rows and blocks after cached keys (each plan), through the kernel: the tokens of
    transformers' own ``generate``, one prompt at a time."""
    from harness.backends.base import GenRequest

    backend = request.getfixturevalue(f"{which}_backend")
    prompts = [p + " " + p for p in sweep_prompts()]  # long enough for the kernel's blocks
    assert backend.describe().attention.startswith("CPU flash attention")  # in the run's settings hash
    assert type(backend).run_identity("x", "cpu", "float32", {})["attention"] == backend.describe().attention
    assert any("flash" in f for f in backend.fused)  # and its record
    expected = []
    for p in prompts:
        ids = backend.tokenizer(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = backend.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                         pad_token_id=backend.tokenizer.eos_token_id or 0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert_varied(expected)
    for plan in ("none", "batch", "tree-rows", "tree-block"):
        before = dict(cpu_flash.CALLS)
        gen = backend.generate_all([GenRequest(p, 12, stop=()) for p in prompts], batch_size=4, prefix_reuse=plan)
        got = [r.token_ids[:12] for r in gen.results(len(prompts))]
        assert all(cpu_flash.CALLS[k] > before[k] for k in ("attention", "decode")), plan
        assert got == expected, plan


def test_turned_off_unbuildable_or_wrong_it_is_left_out_saying_why(tmp_path, monkeypatch, caplog):
    real = cpu_flash.SOURCE
    monkeypatch.setenv("ICR_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_flash.ENV, "off")
    assert not cpu_flash.available(64)
    monkeypatch.delenv(cpu_flash.ENV)
    try:
        cpu_flash._library.cache_clear()
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        with caplog.at_level(logging.WARNING, logger="harness"):
            assert not cpu_flash.available(48)
        assert "not available" in caplog.text and "no-such-compiler" in caplog.text
        monkeypatch.delenv("CXX")
        cpu_flash._library.cache_clear()
        wrong = tmp_path / "wrong.cpp"  # a kernel that scales its scores a little wrong
        wrong.write_text(cpu_flash.SOURCE.read_text().replace("a[i][0] * scale", "a[i][0] * (scale * 1.01f)"))
        monkeypatch.setattr(cpu_flash, "SOURCE", wrong)
        with pytest.warns(UserWarning, match="differs from the SDPA"):
            assert not cpu_flash.available(48)
        monkeypatch.setattr(cpu_flash, "SOURCE", real)
        cpu_flash._library.cache_clear()
        assert cpu_flash.available(48)  # the real kernel, built into this cache once
        built = list((tmp_path / "kernels").glob("cpu_flash_attention-d48-*.so"))
        stamp = [p.stat().st_mtime_ns for p in built]
        cpu_flash._library.cache_clear()
        assert cpu_flash.available(48)  # found, not built again
        assert [p.stat().st_mtime_ns for p in built] == stamp
    finally:
        cpu_flash._library.cache_clear()


def _build(tmp_path, dim: int, *flags: str):
    """The kernel compiled with ``flags`` in place of ``-O3 -march=native``, loaded."""
    out = tmp_path / f"kernel{''.join(flags)}-d{dim}.so"
    base = [f for f in cpu_flash.FLAGS if f not in ("-O3", "-march=native")]
    subprocess.run([shutil.which("g++") or "c++", *base, *flags, f"-DHEAD_DIM={dim}", str(cpu_flash.SOURCE), "-o",
                    str(out)], check=True, capture_output=True)
    return cpu_flash.load(out)


def test_a_kernel_slower_than_sdpa_on_this_machine_is_left_out_saying_why(tmp_path, monkeypatch, caplog):
    """Raced against SDPA once a machine: where it lost, attention stays SDPA's. A real loser: the kernel compiled
    without optimisation."""
    monkeypatch.setenv("ICR_CACHE", str(tmp_path))
    races = tmp_path / "cpu-flash.json"
    try:
        cpu_flash._library.cache_clear()
        assert cpu_flash.available(64)  # built, checked and raced into this cache
        [(key, race)] = json.loads(races.read_text()).items()
        assert race["faster"] and "on 256 queries after 512 keys" in race["why"]
        races.write_text(json.dumps({key: {"faster": False, "why": "SDPA's time over the kernel's 0.50x"}}))
        cpu_flash._library.cache_clear()
        with caplog.at_level(logging.WARNING, logger="harness"):
            assert not cpu_flash.available(64)  # the machine's remembered race stands
        assert "slower than SDPA on this CPU" in caplog.text and "0.50x" in caplog.text
    finally:
        cpu_flash._library.cache_clear()
    threads = torch.get_num_threads()
    lost = cpu_flash.race_sdpa(_build(tmp_path, 64, "-O0"), 64)
    assert not lost["faster"], lost
    assert torch.get_num_threads() == threads  # raced on one thread, the process's count given back


@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma"} <= set(cpu_flash._cpu_flags().split()),
                    reason="builds for x86-64 with AVX2")
@pytest.mark.parametrize("dim", [16, 64, 80])
def test_the_avx2_build_agrees_with_sdpa_as_the_native_one_does(tmp_path, dim):
    """Built for AVX2 (8 floats a vector, what ``-march=native`` gives on most AMD Zen 2/3 and Intel desktop CPUs;
    here also where this CPU has AVX-512): both passes, on every case the load-time check holds the native build
    to, within its tolerance of SDPA."""
    lib = _build(tmp_path, dim, "-O3", "-march=x86-64-v3")
    assert lib.icr_flash_head_dim() == dim
    ours, theirs = cpu_flash._check(lib, dim)
    for a, b in zip(ours, theirs):
        assert b.std() > 0.01 and float((a - b).abs().max() / b.abs().max()) < cpu_flash.TOLERANCE


def test_blocks_without_the_built_mask_or_with_anything_that_changes_the_scores_keep_their_path():
    class Module(torch.nn.Module):
        is_causal = True

    module = Module().eval()
    query, key, value, _ = _case(1, 2, 2, 32, 0, 16, {})
    assert chunked_attention._by_flash(module, query, key, value, {"scaling": 0.25})
    assert not chunked_attention._by_flash(module, query[:, :, :8], key, value, {})  # a few queries: SDPA
    assert not chunked_attention._by_flash(module, query, key, value, {"softcap": 30.0})
    assert not chunked_attention._by_flash(module, query.double(), key.double(), value.double(), {})
    step = torch.randn(1, 8, 1, 16)  # a step's query of 8 heads, over 2 key heads (4 a key head) or 1 (8)
    assert chunked_attention._by_decode_kernel(module, step, key, value, None, {})
    assert not chunked_attention._by_decode_kernel(module, step, key[:, :1], value[:, :1], None, {})
    pair = torch.randn(1, 2, 2, 16)  # two queries a row with no mask: SDPA's causal flag, not a step's
    assert not chunked_attention._by_decode_kernel(module, pair, key, value, None, {})
    assert chunked_attention._by_decode_kernel(module, pair, key, value, torch.zeros(1, 1, 2, 32), {})


def test_the_kernel_is_in_a_cpu_float32_runs_settings_so_rows_with_and_without_it_never_mix(tiny_phi_dir, tmp_path,
                                                                                           monkeypatch):
    from harness.backends.hf import TransformersBackend
    from harness.backends.phi_mamba import PhiMambaBackend
    from harness.engine import run_eval
    from harness.engine.runlog import ResumeMismatchError
    from tests.helpers import run_config

    assert TransformersBackend.run_identity(tiny_phi_dir, "cpu", "float32", {})["attention"].startswith("CPU flash")
    assert "attention" not in TransformersBackend.run_identity(tiny_phi_dir, "cpu", "bfloat16", {})
    assert "attention" not in PhiMambaBackend.run_identity(tiny_phi_dir, "cpu", "float32", {})  # never takes it
    run_eval(run_config(tiny_phi_dir, tmp_path, limit=1), progress=False)
    monkeypatch.setenv(cpu_flash.ENV, "off")
    assert "attention" not in TransformersBackend.run_identity(tiny_phi_dir, "cpu", "float32", {})
    with pytest.raises(ResumeMismatchError, match=r"CPU attention kernel \(ICR_CPU_FLASH\) changed"):
        run_eval(run_config(tiny_phi_dir, tmp_path, limit=2), progress=False)


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_merged_rows_decode_with_their_shared_front_read_from_one_row_and_write_the_same_tokens(which, request,
                                                                                               monkeypatch):
    """The prefix tree's merged rows keep their common front in front: each decoding step's pass reads it from the
    first row (``shared``), and the tokens are those of ``none``, where nothing is shared."""
    from harness.backends.base import GenRequest

    backend = request.getfixturevalue(f"{which}_backend")
    fronts = spy(monkeypatch, cpu_flash, "decode", lambda q, k, v, m, front, s, middles=None: (q.shape[0], front))
    prompts, shared = long_front_prompts(backend.tokenizer)

    def run(plan):
        gen = backend.generate_all([GenRequest(p, 14) for p in prompts], batch_size=len(prompts), prefix_reuse=plan)
        return [r.token_ids for r in gen.results(len(prompts))]

    rows = run("tree-rows")
    assert (len(prompts), shared) in fronts  # the whole batch's rows at once, the front read from one
    none = run("none")
    assert_varied(none)
    assert rows == none


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_rows_sharing_a_middle_read_it_once_a_step_and_write_the_same_tokens_as_rows_leave(which, request,
                                                                                          monkeypatch):
    """Prompts that share more than the batch's front (a long middle, then their own endings) sit next to each
    other in the tree's order; each decoding step reads their middle once for the group (``cpu_flash.Middles``).
    Rows stop at different lengths, so the batch drops rows while groups remain: the tokens are ``none``'s."""
    from harness.backends.base import GenRequest
    from tests.helpers import UNITS

    backend = request.getfixturevalue(f"{which}_backend")
    groups = spy(monkeypatch, cpu_flash, "decode", lambda q, k, v, m, front, s, middles=None:
                 (q.shape[0], None if middles is None else middles.owner.tolist()))
    head = "Read every paragraph first.\n" + "\n".join(UNITS * 3) + "\n"
    middles = ["\n".join(f"Note {k}: the {what} at mile {3 * k} is {colour}." for k in range(14))
               for what, colour in (("river", "wide"), ("lake", "green"), ("road", "dusty"))]
    prompts = [head + middle + f"\nQuestion {i}: {UNITS[i % 4][:14 + 5 * i]}\nAnswer:"
               for middle in middles for i in range(3)]
    budgets = [14, 6, 10, 3, 14, 8, 12, 5, 14]  # rows leave at different steps

    def run(plan):
        gen = backend.generate_all([GenRequest(p, n) for p, n in zip(prompts, budgets)], batch_size=len(prompts),
                                   prefix_reuse=plan)
        return [r.token_ids for r in gen.results(len(prompts))]

    rows = run("tree-rows")
    grouped = [owners for _, owners in groups if owners is not None]
    assert grouped and len(set(grouped[0])) == 3  # three groups of three at first ...
    assert any(len(owners) < len(prompts) and len(set(owners)) < len(owners) for owners in grouped)  # ... then fewer
    none = run("none")
    assert_varied(none)
    assert len({len(r) for r in none}) > 2  # the rows really left at different steps
    assert rows == none


def test_a_groups_middle_is_read_from_its_first_row_and_middles_follow_the_rows_a_batch_keeps():
    """``cpu_flash.Middles``: row r's keys from the front to its group's end are read from the group's first row
    (here row 2's copy is spoiled, and only a pass that reads it from row 1 gives SDPA's answer over row 1's);
    groups that lose rows keep their middle, owned by their first row left; what the kernel relies on is checked."""
    if not cpu_flash.available(64):
        pytest.skip("the CPU flash kernel is not built here")
    gen = torch.Generator().manual_seed(3)
    rows, heads, keys, front, end = 4, 4, 300, 100, 220
    key, value = (torch.randn(rows, heads, keys, 64, generator=gen) for _ in range(2))
    for x in (key, value):
        x[1:, :, :front] = x[0, :, :front]
        x[2, :, front:end] = x[1, :, front:end]
    query = torch.randn(rows, heads, 1, 64, generator=gen)
    middles = cpu_flash.Middles.of([(0, front), (1, end), (1, end), (3, front)], front)
    want = F.scaled_dot_product_attention(query, key, value, scale=0.125).transpose(1, 2)
    with torch.inference_mode():
        plain = cpu_flash.decode(query, key, value, None, front, 0.125)
        spoiled_k, spoiled_v = key.clone(), value.clone()
        spoiled_k[2, :, front:end] += 1.0
        spoiled_v[2, :, front:end] -= 1.0
        once = cpu_flash.decode(query, spoiled_k, spoiled_v, None, front, 0.125, middles)
        alone = cpu_flash.decode(query, spoiled_k, spoiled_v, None, front, 0.125)
    assert (plain - want).abs().max() < 1e-5 and (once - want).abs().max() < 1e-5
    assert (alone[2] - want[2]).abs().max() > 1e-2  # without the middles row 2 reads its own (spoiled) copy
    five = cpu_flash.Middles.of([(0, front), (1, end), (1, end), (1, end), (4, front)], front)
    kept = five.select([0, 2, 3, 4])  # the group's first row left: the next one owns the middle
    assert kept.owner.tolist() == [0, 1, 1, 3] and kept.end.tolist()[1] == end
    assert five.select([0, 1, 4]) is None and five.select([2, 1, 0, 3]) is None  # a group of one; rows reordered
    for bad in ([(0, front), (0, end), (1, end)], [(1, end), (1, end)], [(0, front), (1, front - 1)]):
        with pytest.raises(ValueError, match="middles"):
            cpu_flash.Middles.of(bad, front)
    with pytest.raises(ValueError, match="32 queries a row and key head at most"):  # the pass's own limit
        cpu_flash.decode(torch.randn(1, 4, 9, 64), key[:1, :1], value[:1, :1], None, 0, 0.125)
