"""The trainer's graphed optimizer step (harness.training.step_graphs) with capture off: the static buffers, the
tensor learning rate the scheduler fills, the per-shape warm-up, the eager fallback past ``MAX_SHAPES`` and the
gradients' hand-over between graphed and eager steps, against the trainer's plain ``optimizer_step``. Capture
and replay need CUDA: the quick GPU suite runs ``check_graphed_steps`` there."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.training import step_graphs
from harness.training.config import TrainConfig
from harness.training.data import TrainingBatches, TrainTask
from harness.training.step_graphs import GraphedSteps, check_graphed_steps
from harness.training.step import lr_at, new_model, new_optimizer, optimizer_step

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", ["transformer", "mamba", "hybrid"])
def test_graphed_steps_train_as_eager_steps_do(arch):
    cell = TrainConfig(arch=arch, size="smoke", nodes=4, setup="retrieval", report_to="none").resolved()
    r = check_graphed_steps(cell, CPU, 4, steps=6)
    assert r["varied"] and r["replays"] == 6 - step_graphs.WARMUP
    assert r["loss_diff"] <= 1e-5 and r["weight_diff"] <= 1e-5, r


def test_shapes_past_the_limit_and_eager_steps_between_replays(monkeypatch):
    """Three batch shapes interleaved with room for two graphs: the third trains eagerly, between replays whose
    gradients must not leak into it; weights end as plain steps leave them."""
    monkeypatch.setattr(step_graphs, "MAX_SHAPES", 2)
    cell = TrainConfig(arch="mamba", size="smoke", nodes=4, setup="retrieval", report_to="none").resolved()
    task = TrainTask(cell)
    base = TrainingBatches(task, 4, cell.seed, 0).pool(0)[0]
    shapes = [(base[0][:, :n], base[1][:, :n]) for n in (base[0].shape[1], base[0].shape[1] - 3,
                                                         base[0].shape[1] - 5)]
    order = [0, 0, 1, 1, 0, 1, 2, 0, 2, 1, 2, 0]  # shape 2 arrives when both graphs exist: eager, between replays

    def train(graphed: bool):
        torch.manual_seed(0)
        model = new_model(cell, task)
        opt = new_optimizer(cell, model, CPU, graphs=True)  # the same optimizer: only the step differs
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, len(order), 2))
        step = GraphedSteps(model, opt, "cpu", False, capture=False) if graphed else None
        losses = []
        for k in order:
            ids, mask = shapes[k]
            loss = step(ids, mask) if step else optimizer_step(model, opt, ids, mask, torch.autocast("cpu", enabled=False))
            losses.append(float(loss.detach()))
            sched.step()
        return losses, torch.cat([p.detach().flatten() for p in model.parameters()]), step

    plain_losses, plain_w, _ = train(False)
    losses, w, step = train(True)
    assert len(set(plain_losses)) > 1
    assert losses == pytest.approx(plain_losses, rel=1e-6) and torch.allclose(w, plain_w, rtol=0, atol=1e-6)
    assert len(step.cache.graphs) == 2 and step.replays == 3 + 2  # shapes 0 and 1, each after two eager warm-ups


@pytest.mark.slow
def test_the_cli_refuses_graphs_without_cuda(tmp_path):
    res = subprocess.run([sys.executable, "-m", "harness.train", "--arch", "mamba", "--size", "smoke", "--nodes", "4",
                          "--setup", "direct", "--samples", "64", "--batch-size", "8", "--output", str(tmp_path / "r"),
                          "--cuda-graphs", "on"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "error: --cuda-graphs on replays training steps on a CUDA device" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "r").exists()


@pytest.mark.parametrize("agrees", [True, False])
def test_auto_trains_from_graphs_only_where_its_check_agrees(agrees, tmp_path, monkeypatch):
    """``--cuda-graphs auto`` through the trainer with capture off (its CUDA-only part): a cell whose check
    passes trains on the graphs' static buffers; one whose check replays nothing (here: each shape's eager
    warm-up outlasting the check's 8 steps, as batches of ever new lengths would) trains eagerly, the reason in
    result.json. Either way the run is the one ``off`` trains: the check's models and batches leave the run's
    seed, data and losses alone."""
    from harness.training import trainer

    def run(graphs: str) -> dict:
        cfg = TrainConfig(arch="mamba", size="smoke", nodes=4, setup="direct", samples=48, batch_size=4,
                          eval_every=24, eval_samples=8, live_eval=False, report_to="none", cuda_graphs=graphs,
                          output=str(tmp_path / graphs)).resolved()
        return trainer.train_one(cfg)

    plain = run("off")
    monkeypatch.setattr(trainer, "graphs_setting", lambda cfg, device_type, processes: cfg.cuda_graphs)
    monkeypatch.setattr(trainer, "GraphedSteps", lambda *a, **k: GraphedSteps(*a, **k, capture=False))
    if not agrees:
        monkeypatch.setattr(step_graphs, "WARMUP", 8)
    auto = run("auto")
    check = auto["graphs_check"]
    assert check["ok"] is agrees and auto["train_step"] == ("static buffers" if agrees else f"eager ({check['why']})")
    assert agrees or "no step was replayed within 8" in check["why"]
    curve = [p["loss"] for p in plain["curve"]]
    assert len(set(curve)) > 1 and [p["loss"] for p in auto["curve"]] == pytest.approx(curve, rel=1e-6)
