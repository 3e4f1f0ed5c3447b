"""The prefix tree (``--prefix-reuse tree``): every prefix prompts share is prefilled once, and generations are
those of ``batch`` and ``none``, token for token, with tool calls, under a memory budget and on resume."""
import json
import random

import pytest

from harness.backends.base import GenRequest
from harness.backends.prefix_tree import PrefixTree, parse_bytes
from harness.engine import run_eval
from harness.engine.config import ConfigError, RunConfig
from retrieval import RetrievalTool
from tests.helpers import assert_varied, long_front_prompts, spy, sweep_prompts
from tests.helpers import UNITS


def _distinct_prefixes(seqs) -> int:
    return len({tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)})


def test_tree_holds_each_distinct_token_once_and_keeps_subtrees_consecutive():
    rng = random.Random(0)
    stem = [rng.randrange(5) for _ in range(30)]
    seqs = [stem[:rng.randrange(1, 30)] + [rng.randrange(3) for _ in range(rng.randrange(0, 6))] for _ in range(60)]
    seqs += [seqs[3], seqs[3][:2]]  # a duplicate, and a prompt that is a prefix of another
    tree = PrefixTree(seqs)
    assert tree.tree_tokens == _distinct_prefixes(seqs) < sum(map(len, seqs))
    for i, s in enumerate(seqs):
        assert [t for n in tree.path(i) for t in n.ids] == s
    order = tree.order()
    assert sorted(order) == list(range(len(seqs)))
    where = {i: k for k, i in enumerate(order)}
    for node in tree.nodes():  # every subtree's prompts are one run of the order (its snapshot can be freed)
        below = [where[i] for i in range(len(seqs)) if node in tree.path(i) or node is tree.root]
        assert max(below) - min(below) + 1 == len(below)


def test_memory_amounts_parse_and_bad_ones_are_refused(tmp_path):
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512 MB") == 512 * 10 ** 6 and parse_bytes("1e3") == 1000
    for bad in ("lots", "-1GiB", "4 parsecs"):
        with pytest.raises(ValueError, match="4GiB"):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match="--prefix-memory 'lots'"):
        RunConfig(task="hotpotqa", model="x", prefix_memory="lots", device="cpu").validate()
    assert RunConfig(task="hotpotqa", model="x", prefix_reuse=False).prefix_reuse == "none"  # the former on/off flag


def _requests(backend, prompts, tools=None):
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    return [GenRequest(p, 14, tool=tools[k] if tools else None, prompt_ids=i)
            for k, (p, i) in enumerate(zip(prompts, ids))]


def _modes(backend, make_requests, batch=4):
    """Each plan's generations of the same requests (fresh request objects each), and the tokens it prefilled."""
    out = {}
    for mode in ("none", "batch", "tree-rows", "tree-block"):
        gen = backend.generate_all(make_requests(), batch_size=batch, prefix_reuse=mode)
        results = gen.results(len(make_requests()))
        assert gen.plan.mode == mode.split("-")[0] and (gen.plan.ran == mode or mode == "tree")
        out[mode] = (results, gen.plan.prefill_tokens)
    return out


@pytest.mark.parametrize("which", ["phi", "llama", "phi_mamba", "hybrid"])
def test_tree_generations_equal_batch_and_none_with_tool_calls(which, request):
    backend = request.getfixturevalue(f"{which}_backend")
    assert backend.tree_unsupported() is None
    prompts = sweep_prompts()
    free = [r.text for r in backend.generate(_requests(backend, prompts))]

    def with_tools():  # call markers the model writes itself, so its tool is really called mid-generation
        return _requests(backend, prompts, [RetrievalTool(UNITS, call_open=f[0:2], call_close=f[5:8]) for f in free])

    got = _modes(backend, with_tools)
    none = got["none"][0]
    assert_varied([r.token_ids for r in none])
    assert sum(len(r.tool_spans) for r in none) >= 2
    for mode, (results, _) in got.items():
        assert [r.token_ids for r in results] == [r.token_ids for r in none], mode
        assert [r.text for r in results] == [r.text for r in none], mode
    ids = [r.prompt_ids for r in _requests(backend, prompts)]
    assert got["tree-rows"][1] == PrefixTree(ids).tree_tokens < 0.7 * sum(map(len, ids))  # each shared token once
    assert got["tree-rows"][1] < got["tree-block"][1] < got["batch"][1]  # the block pads, but reads the tree


def test_a_snapshot_that_does_not_fit_is_recomputed_not_kept(phi_backend):
    prompts = sweep_prompts()
    ids = [r.prompt_ids for r in _requests(phi_backend, prompts)]
    plain = [r.token_ids for r in phi_backend.generate(_requests(phi_backend, prompts))]
    assert_varied(plain)
    one = phi_backend.state_bytes(max(map(len, ids)))
    computed = {}
    for budget in (0, one, 1 << 30):
        for mode in ("tree-rows", "tree-block"):
            gen = phi_backend.generate_all(_requests(phi_backend, prompts), batch_size=3, prefix_reuse=mode,
                                           prefix_memory=budget)
            got = gen.results(len(prompts))
            assert [r.token_ids for r in got] == plain, f"budget {budget}, {mode}"
            info = gen.plan.to_json()  # within the budget; everything freed at the end
            assert info["prefix_snapshot_peak_bytes"] <= budget and info["prefix_snapshot_left_bytes"] == 0
            if mode == "tree-rows":
                computed[budget] = info["prefill_tokens"]
    assert computed[0] == sum(map(len, ids))  # nothing kept: every prompt whole
    assert computed[1 << 30] == PrefixTree(ids).tree_tokens < computed[one] < computed[0]


def _run(model, out, mode, limit, backend=None, batch_size="3", batching="continuous"):
    positions = ["0", "1", "2", "3", "last"]
    cfg = RunConfig(task="hotpotqa", model=model, data="fixture", task_args={"distractors": 4, "positions": positions}, limit=limit,
                    max_new_tokens=10, device="cpu", dtype="float32", output=str(out), batch_size=batch_size,
                    prefix_reuse=mode, prefix_memory="1GiB",  # not a quarter of what is free: a busy machine's
                    batching=batching)
    res = run_eval(cfg, backend=backend, progress=False)
    return res, {json.loads(l)["key"]: json.loads(l)["generation"] for l in open(out / "samples.jsonl")}


def test_engine_modes_agree_record_their_prefill_and_resume_into_one_run(tiny_phi_dir, phi_backend, tmp_path):
    # the tree's rows forced: its block prefill (which auto may pick by timing) counts a block's pads as prefilled
    results = {m.split("-")[0]: _run(tiny_phi_dir, tmp_path / m, m, 4, phi_backend)
               for m in ("tree-rows", "batch", "none")}
    gens = {m: g for m, (_, g) in results.items()}
    assert_varied(gens["none"].values())
    assert gens["tree"] == gens["batch"] == gens["none"]
    t = {m: r["timings"] for m, (r, _) in results.items()}
    assert {x["prefix_reuse"] for x in t.values()} == {"tree", "batch", "none"}
    assert {(x["batching"], x["batching_reason"]) for x in t.values()} == {  # rows refilled as they finish
        ("continuous", "3 slots, refilled as rows finish")}
    static, gens["static"] = _run(tiny_phi_dir, tmp_path / "static", "tree", 4, phi_backend, batching="auto")
    assert static["timings"]["batching"] == "static" and gens["static"] == gens["none"]  # auto: keys on a CPU
    assert t["tree"]["prompt_tokens"] == t["batch"]["prompt_tokens"] == t["none"]["prompt_tokens"]
    assert t["tree"]["prefill_tokens"] == t["tree"]["tree_tokens"] < t["batch"]["prefill_tokens"] < \
        t["none"]["prefill_tokens"]
    assert results["tree"][0]["config_hash"] == results["none"][0]["config_hash"]  # the mode is not a setting
    # a run started in one mode resumes in another: finished rows are not in the tree, nothing is mixed
    part, _ = _run(tiny_phi_dir, tmp_path / "resumed", "none", 2, phi_backend)
    full, resumed = _run(tiny_phi_dir, tmp_path / "resumed", "tree", 4, phi_backend, batch_size="auto")
    assert full["counts"]["resumed"] == part["counts"]["instances"] > 0
    assert full["timings"]["prompt_tokens"] == t["tree"]["prompt_tokens"] - part["timings"]["prompt_tokens"]
    assert resumed == gens["none"]


def test_tree_mode_falls_back_where_rows_cannot_merge(tiny_phi_dir, phi_backend, tmp_path, caplog):
    from tests.helpers import ScriptedBackend

    scripted = ScriptedBackend(phi_backend, lambda prompt: None)  # the model's own logits; no merge of its own
    with caplog.at_level("INFO", logger="harness"):
        res, _ = _run(tiny_phi_dir, tmp_path / "f", "tree", 2, scripted)
    t = res["timings"]
    assert t["prefix_reuse"] == "batch" and t["prefix_reuse_asked"] == "tree"
    assert "tree is not possible here: the scripted backend cannot merge rows" in t["plan_reason"]
    assert t["batching"] == "static" and t["batching_reason"] == "the scripted backend cannot join batches"
    assert t["plan_reason"] in caplog.text


def test_ranks_split_into_runs_of_shared_prefixes():
    from evals.base import Instance
    from harness.engine.run import rank_share

    todo = [Instance(id=f"q{q}", condition=str(p), answer="") for p in range(5) for q in range(4)]
    prompts = {i.key: f"shots {i.id} " + "d " * int(i.condition) + "gold" for i in todo}
    shares = [rank_share(todo, prompts, r, 2) for r in range(2)]
    assert sorted(i.key for s in shares for i in s) == sorted(i.key for i in todo)  # every instance once
    assert [sorted({i.id for i in s}) for s in shares] == [["q0", "q1"], ["q2", "q3"]]  # a question on one rank
    assert shares[0] == [i for i in todo if i.id in ("q0", "q1")]  # instance order kept


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_rows_sharing_a_long_front_read_it_once_a_step_and_write_the_same_tokens(which, request, monkeypatch):
    """On a CPU the tree's merged rows keep their common front in front (pads after it), and each decoding step
    attends over it once for all rows (``chunked_attention.front_once_attention``): the same tokens as ``none``."""
    from harness.backends import chunked_attention

    monkeypatch.setenv("ICR_CPU_FLASH", "off")  # PyTorch's kernels; the flash kernel's pass: tests/test_cpu_flash.py
    backend = request.getfixturevalue(f"{which}_backend")
    assert backend.merges_shared_front()
    calls = spy(monkeypatch, chunked_attention, "front_once_attention", lambda q, k, v, m, front, s: (q.shape[0], front))
    prompts, shared = long_front_prompts(backend.tokenizer)
    assert shared >= chunked_attention.SHARED_MIN
    gen = backend.generate_all(_requests(backend, prompts), batch_size=len(prompts), prefix_reuse="tree-rows")
    rows = gen.results(len(prompts))
    assert gen.plan.ran == "tree-rows" and calls and {s for _, s in calls} == {shared}
    assert {b for b, _ in calls} >= {len(prompts)}  # the whole batch's rows at once
    none = backend.generate_all(_requests(backend, prompts), batch_size=len(prompts), prefix_reuse="none")
    none = none.results(len(prompts))
    assert_varied([r.token_ids for r in none])
    assert [r.token_ids for r in rows] == [r.token_ids for r in none]


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_rows_prefilled_into_their_slots_merge_without_a_copy_into_the_merged_rows_positions(which, request):
    """On a CPU the tree's rows each prefill into their row of one buffer a layer (``MergesRows.row_slots``), their
    pads after their own tokens: the batch needs no join. A row prefilled elsewhere (here the last) is copied in.
    Each row's keys and values are the ones ``merge`` puts after its pads, to the bit."""
    import torch

    from harness.backends.prefix_tree import PrefixStates

    backend = request.getfixturevalue(f"{which}_backend")
    prompts, shared = long_front_prompts(backend.tokenizer)
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    lengths, width = [len(i) for i in ids], max(map(len, ids))
    assert len(set(lengths)) > 1  # pads to place
    slots = backend.row_slots(len(ids), width)
    assert slots is not None

    def started(into):
        states = PrefixStates(backend, PrefixTree(ids), 1 << 30)
        order = PrefixTree(ids).order()
        rows = {i: states.start(i, into if i != order[-1] else None, i) for i in order}
        return [rows[i] for i in range(len(ids))]

    rows = started(slots)
    cache = [r.state["cache"] for r in rows]
    placed = [c.layers[0].keys.data_ptr() == slots.buffers[0, "keys"][k].data_ptr() for k, c in enumerate(cache)]
    assert placed == [k != PrefixTree(ids).order()[-1] for k in range(len(ids))]
    with torch.inference_mode():
        merged = backend.merge_slots([r.state for r in rows], ids, shared, slots)["cache"]
        plain = backend.merge([r.state for r in started(None)], lengths, shared)["cache"]
    for i, (layer, other) in enumerate(zip(merged.layers, plain.layers)):
        for name in ("keys", "values"):
            got, want = getattr(layer, name), getattr(other, name)
            assert got.shape == want.shape and got.data_ptr() == slots.buffers[i, name].data_ptr()
            assert want.std() > 0.1
            for k, n in enumerate(lengths):
                pads = width - n
                assert torch.equal(got[k, :, :shared], want[k, :, :shared])
                assert torch.equal(got[k, :, shared:n], want[k, :, shared + pads:])  # merge pads after the front
                assert not got[k, :, n:].any()  # the pads: zeros, masked
