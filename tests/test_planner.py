"""The prefill planner (``harness.backends.planner``): what it may choose comes from the backend, what it does
choose from the cost model, and the choice, its reason and its estimates are reported."""
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from harness import cache
from harness.backends.base import GenRequest

from harness.cache import OthersBusy, machine_key
from harness.backends.planner import Costs, _per_token_and_pair, batching, forget_costs, make_plan, measure_costs
from harness.backends.prefix_tree import PrefixTree
from tests.helpers import sweep_prompts

CPU_LIKE = Costs(call=1e-3, row_token=1e-4, batch_token=3e-4, length=256, rows=2)  # a row is the cheap token
GPU_LIKE = Costs(call=5e-2, row_token=1e-4, batch_token=2e-6, length=256, rows=4)  # calls dear, batches cheap


def _ids(backend):
    return [backend.tokenizer(p)["input_ids"] for p in sweep_prompts()]


@pytest.fixture
def any_load(monkeypatch):
    """A measurement counts as taken on quiet cores however busy they are (CI's are shared): for tests of what is
    remembered, not of when."""
    monkeypatch.setattr(cache, "BUSY_SHARE", 1.0)


def test_auto_takes_the_plan_the_cost_model_prices_lowest(phi_backend):
    ids = _ids(phi_backend)
    cpu = make_plan(phi_backend, ids, 8, 4, "auto", costs=CPU_LIKE)
    gpu = make_plan(phi_backend, ids, 8, 4, "auto", costs=GPU_LIKE)
    assert set(cpu.estimates) == {"tree-rows", "tree-block", "batch", "none"}
    for plan in (cpu, gpu):  # the cheapest estimate ran, and the reason lists them
        assert plan.name == min(plan.estimates, key=plan.estimates.get)
        assert "fastest by the measured cost model" in plan.reason
    assert cpu.name == "tree-rows" and gpu.name != "tree-rows"
    assert cpu.estimates["none"] > cpu.estimates["batch"]  # fewer tokens, at the same rates
    record = cpu.record()  # the typed record and what results.json holds of it
    assert record.ran == "tree-rows" and record.mode == "tree" and record.asked == "auto"
    info = record.to_json()
    assert info["prefix_reuse"] == "tree" and info["tree_prefill"] == "rows" and info["prefix_reuse_asked"] == "auto"
    assert list(info)[:4] == ["prefix_reuse", "prefix_reuse_asked", "plan_reason", "tree_prefill"]


def test_a_plan_asked_for_is_kept_where_possible_and_falls_back_with_its_reason(phi_backend, hybrid_backend):
    from tests.helpers import ScriptedBackend

    ids = _ids(phi_backend)
    assert make_plan(phi_backend, ids, 8, 4, "batch").name == "batch"
    assert make_plan(phi_backend, ids, 8, 4, "tree-block").name == "tree-block"
    assert make_plan(phi_backend, ids, 8, 1, "tree-block").name == "tree-rows"  # one prompt a batch: no block
    scripted = ScriptedBackend(phi_backend, lambda prompt: None)  # cannot merge rows
    plan = make_plan(scripted, ids, 8, 4, "tree")
    assert plan.name == "batch" and "cannot merge rows" in plan.reason and not plan.estimates
    one = make_plan(hybrid_backend, ids[:1], 8, 4, "auto")
    assert one.name == "none" and not one.estimates  # nothing to choose: nothing measured
    with pytest.raises(ValueError, match="prefix reuse 'sometimes'"):
        make_plan(phi_backend, ids, 8, 4, "sometimes")


def test_the_tree_plans_order_batches_depth_first(phi_backend):
    ids = _ids(phi_backend)
    plan = make_plan(phi_backend, ids, 8, 3, "tree-rows")
    assert [i for b in plan.batches for i in b] == PrefixTree(ids).order()
    assert max(map(len, plan.batches)) == 3


def test_the_cost_model_is_measured_once_a_machine_and_model_shape(phi_backend, hybrid_backend, tmp_path,
                                                                   monkeypatch, any_load):
    monkeypatch.setenv("ICR_CACHE", str(tmp_path))
    remembered = lambda: json.loads((tmp_path / "cost-models.json").read_text())  # noqa: E731
    forget_costs(phi_backend, remembered=True)  # nothing remembered yet: nothing to forget, nothing written
    assert not (tmp_path / "cost-models.json").exists()
    first = measure_costs(phi_backend, 64, 2)
    assert first.call > 0 and first.row_token >= 0 and first.batch_token >= 0
    assert measure_costs(phi_backend, 64, 2) is first  # this process's
    assert first.describe()["measured_at"] == [2, 64]
    [(key, rates)] = remembered().items()
    assert rates == first.rates() and key.startswith(machine_key()) and key.endswith("2 x 64")
    forget_costs(phi_backend)  # as a fresh process on this machine: read, not measured (its seconds would differ)
    again = measure_costs(phi_backend, 64, 2)
    assert again is not first and again == first and "_prefill_costs" not in vars(phi_backend)
    measure_costs(hybrid_backend, 64, 2)  # another model, or another length, is measured for itself
    measure_costs(phi_backend, 32, 2)
    assert len(remembered()) == 3
    forget_costs(phi_backend, remembered=True)  # as the machine's first run: measured again
    assert measure_costs(phi_backend, 64, 2) != first
    assert len(remembered()) == 2 and key in remembered()
    (tmp_path / "cost-models.json").write_text(json.dumps({key: {"call": "soon"}}))  # unusable: measured again
    forget_costs(phi_backend)
    fixed = measure_costs(phi_backend, 64, 2)
    assert remembered()[key] == fixed.rates() != first.rates()


def test_a_cost_model_measured_beside_busy_processes_serves_its_run_and_is_not_remembered(phi_backend, tmp_path,
                                                                                        monkeypatch, caplog):
    """The machine's first cost model stands for every later run: one timed beside other work (a test suite, a
    training run) would have every later run take the plan it priced wrongly."""
    monkeypatch.setenv("ICR_CACHE", str(tmp_path))
    forget_costs(phi_backend, remembered=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * os.cpu_count())]
    try:
        time.sleep(0.5)  # the spinners started
        with OthersBusy() as busy, caplog.at_level(logging.INFO, logger="harness"):
            costs = measure_costs(phi_backend, 64, 2)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert busy.share > cache.BUSY_SHARE  # the real processes kept the cores busy
    assert costs.call > 0 and measure_costs(phi_backend, 64, 2) is costs  # this run plans with it
    assert not (tmp_path / "cost-models.json").exists()
    assert "not remembered for the machine" in caplog.text and "of the cores" in caplog.text


def test_a_token_s_context_is_priced_by_its_pairs_and_the_two_rates_are_recovered_from_two_lengths():
    costs = Costs(call=1e-3, row_token=2e-5, batch_token=3e-5, length=1024, rows=2, row_pair=1e-8, batch_pair=2e-8)
    # 100 tokens after 50 cached: 100 * 50 pairs with the cached keys, 100 * 101 / 2 among themselves
    assert costs.prefill(1, 100, 50) == pytest.approx(1e-3 + 100 * 2e-5 + (100 * 50 + 5050) * 1e-8)
    assert costs.prefill(4, 100, 50) == pytest.approx(1e-3 + 4 * (100 * 3e-5 + (100 * 50 + 5050) * 2e-8))
    t = lambda n, token, pair: n * token + n * (n + 1) / 2 * pair  # noqa: E731
    for token, pair in [(2e-5, 1e-8), (5e-6, 3e-8), (1e-5, 0.0)]:
        assert _per_token_and_pair(256, 1024, t(256, token, pair), t(1024, token, pair)) == pytest.approx(
            (token, pair), rel=1e-6, abs=1e-15)
    # noise that would make a rate negative leaves it at zero, the other carrying the time
    assert _per_token_and_pair(256, 1024, 0.01, 0.02) == (pytest.approx(0.02 / 1024), 0.0)
    token, pair = _per_token_and_pair(256, 1024, 1e-6, 0.05)
    assert token == 0.0 and pair == pytest.approx(0.05 / (1024 * 1025 / 2))


def test_the_plans_are_priced_by_what_their_tokens_attend_to(phi_backend):
    """Prompts behind a long common front, whose rests differ in length: at the same rates a token, the pairs make
    a padded batch dearer than the tree's rows, which attend over no pads; priced per token alone they looked
    closer (the 24 HotpotQA prompts: 1.16x apart, measured 1.9x)."""
    ids = _ids(phi_backend)
    flat = Costs(call=1e-3, row_token=2e-5, batch_token=2e-5, length=256, rows=2)
    paired = Costs(call=1e-3, row_token=2e-5, batch_token=2e-5, length=256, rows=2, row_pair=2e-8, batch_pair=2e-8)
    a, b = (make_plan(phi_backend, ids, 8, len(ids), "auto", costs=c).estimates for c in (flat, paired))
    assert b["tree-rows"] > a["tree-rows"] and b["batch"] > a["batch"]
    assert b["batch"] / b["tree-rows"] > a["batch"] / a["tree-rows"]


def test_a_cost_model_remembered_without_the_pair_rates_is_measured_again(phi_backend, tmp_path, monkeypatch,
                                                                         any_load):
    monkeypatch.setenv("ICR_CACHE", str(tmp_path))
    forget_costs(phi_backend, remembered=True)
    first = measure_costs(phi_backend, 64, 2)
    [key] = json.loads((tmp_path / "cost-models.json").read_text())
    older = {k: v for k, v in first.rates().items() if not k.endswith("_pair")}  # what an older version kept
    (tmp_path / "cost-models.json").write_text(json.dumps({key: older}))
    forget_costs(phi_backend)
    again = measure_costs(phi_backend, 64, 2)
    assert set(json.loads((tmp_path / "cost-models.json").read_text())[key]) == set(first.rates())
    assert again.rates() != older


def test_rows_are_refilled_where_the_backend_joins_batches_and_the_choice_is_recorded(phi_backend,
                                                                                      phi_mamba_backend):
    from tests.helpers import ScriptedBackend

    ids = _ids(phi_backend)
    several, one = make_plan(phi_backend, ids, 8, 4, "none"), make_plan(phi_backend, ids, 8, len(ids), "none")
    assert len(several.batches) > 1 and len(one.batches) == 1
    refilled = ("continuous", "4 slots, refilled as rows finish")
    assert batching(phi_mamba_backend, several) == refilled  # a fixed-size state: continuous by default
    # a model that mostly attends, on a CPU: a join pads every row's keys, and attention there costs what it computes
    assert phi_backend.key_share() == 1.0 and phi_mamba_backend.key_share() == 0.0
    assert batching(phi_backend, several) == ("static", "on a CPU, a model whose layers mostly attend would attend "
                                                        "over joined batches' padded keys (continuous: asked for only)")
    assert batching(phi_backend, several, "continuous") == refilled
    assert batching(phi_mamba_backend, one) == ("static", "one batch")
    assert batching(phi_mamba_backend, several, "static") == ("static", "asked for")
    scripted = ScriptedBackend(phi_backend, lambda prompt: None)  # no join of its own
    assert batching(scripted, several, "continuous") == ("static", "the scripted backend cannot join batches")
    with pytest.raises(ValueError, match="batching 'dynamic'"):
        batching(phi_backend, several, "dynamic")
    gen = phi_mamba_backend.generate_all([GenRequest(None, 4, prompt_ids=i) for i in ids], batch_size=4,
                                         prefix_reuse="none")
    results = gen.results(len(ids))  # the record is complete once the run has ended
    assert all(r.new_tokens > 0 for r in results)
    assert (gen.plan.to_json()["batching"], gen.plan.to_json()["batching_reason"]) == refilled
