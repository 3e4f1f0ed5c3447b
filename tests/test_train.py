"""The trainer: the paper's initialisation and norms, its metric and protocol (teacher-forced exact match, the
last validation reported; a best checkpoint only chosen on a disjoint validation split), the global batch, data
workers, grids and the command line."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evals import istree
from evals.synthetic import loss_mask
from harness.engine.config import ConfigError
from harness.models.istree import build_model
from harness.train import main
from harness.training.config import TrainConfig
from harness.training.data import TrainingBatches, TrainTask, batch_from_tokens
from harness.training.trainer import teacher_forced

ROOT = Path(__file__).resolve().parent.parent


def _tiny(tmp_path, **kw) -> TrainConfig:
    base = dict(arch="transformer", size="smoke", nodes=4, setup="cot", samples=320, batch_size=16, warmup=32,
                lr=3e-3, eval_every=80, eval_samples=24, eval_batch_size=24, report_to="none",
                output=str(tmp_path / "run"))
    return TrainConfig(**{**base, **kw}).resolved()


# ------------------------------------------------------------------------------------------ fidelity
@pytest.mark.parametrize("arch", ["mamba", "hybrid"])
def test_mamba_layers_are_initialised_as_mamba_ssm_does(arch):
    torch.manual_seed(0)
    model = build_model(arch, "0.5M", 40)
    layers = model.backbone.layers
    n_layer = len(layers)
    for block in layers:
        mix = block.mixer
        # PyTorch's default Linear init: U(+-1/sqrt(fan_in)); out_proj then divided by sqrt(n_layer)
        bound = 1 / math.sqrt(mix.in_proj.in_features)
        assert 0.9 * bound < mix.in_proj.weight.abs().max() <= bound
        out_bound = 1 / math.sqrt(mix.out_proj.in_features) / math.sqrt(n_layer)
        assert 0.9 * out_bound < mix.out_proj.weight.abs().max() <= out_bound
        assert mix.conv1d.bias.abs().max() > 0  # torch's default conv bias, not zeros
        rank = mix.dt_proj.in_features
        assert mix.dt_proj.weight.abs().max() <= rank ** -0.5
        dt = torch.nn.functional.softplus(mix.dt_proj.bias)
        assert dt.min() >= 1e-4 - 1e-7 and dt.max() <= 0.1 + 1e-6 and dt.max() / dt.min() > 10  # log-uniform
        assert torch.allclose(mix.A_log.exp()[0], torch.arange(1, mix.A_log.shape[1] + 1, dtype=torch.float32))
        assert torch.all(mix.D == 1)
    norm = model.backbone.norm_f
    assert math.isclose(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)), 1e-5)


def test_transformers_own_mamba_init_would_fail_the_check():
    """The check above can fail: transformers' init draws out_proj from N(0, 0.1) without the depth rescale."""
    from transformers import MambaForCausalLM

    from harness.models.istree import _mamba_config

    torch.manual_seed(0)
    plain = MambaForCausalLM(_mamba_config(40, 64, 16))
    mix = plain.backbone.layers[0].mixer
    assert mix.out_proj.weight.abs().max() > 1 / math.sqrt(mix.out_proj.in_features) / math.sqrt(16)


def test_attention_layers_follow_the_papers_conventions():
    torch.manual_seed(0)
    tr = build_model("transformer", "0.5M", 40)
    assert tr.config.rms_norm_eps == 1e-5  # Llama-2's config, which the paper's code loads
    assert 0.015 < float(tr.model.layers[0].self_attn.q_proj.weight.detach().std()) < 0.025  # N(0, 0.02)
    hy = build_model("hybrid", "0.5M", 40)
    q = hy.attn.self_attn.q_proj.weight
    assert hy.attn.input_layernorm.variance_epsilon == 1e-5
    # built after mamba-ssm's init pass in the paper's code: PyTorch's default, U(+-1/sqrt(fan_in))
    assert 0.9 / math.sqrt(q.shape[1]) < q.abs().max() <= 1 / math.sqrt(q.shape[1])
    assert float(q.detach().std()) > 0.05  # not N(0, 0.02)


def test_graph_types_are_named_for_what_they_are():
    assert istree.GRAPHS == ("binary", "recursive")
    from evals import get_task

    with pytest.raises(ValueError, match="recursive"):
        get_task("istree", graph="random")


# ------------------------------------------------------------------------------------------ metric
def test_teacher_forced_exact_match_is_every_target_token():
    """An untrained model's EM computed by hand, sample by sample, equals the batched metric; and an EM of 1
    needs every loss-mask target right (a model forced to predict the gold tokens scores 1)."""
    cfg = TrainConfig(nodes=4, setup="retrieval", eval_samples=12, report_to="none").resolved()
    task = TrainTask(cfg)
    vocab = {t: i for i, t in enumerate(task.vocab)}
    samples = task.heldout()
    assert len(samples) == 12 and all(s[0] == istree.BOS for s in samples)
    assert len({tuple(s) for s in samples}) > 1
    torch.manual_seed(0)
    model = build_model("transformer", "smoke", len(task.vocab)).eval()
    batches = [batch_from_tokens(samples[:7], vocab, "cpu"), batch_from_tokens(samples[7:], vocab, "cpu")]
    _, right, count = teacher_forced(model, batches, _no_autocast)
    by_hand = 0
    for s in samples:
        ids = torch.tensor([[vocab[t] for t in s]])
        pred = model(input_ids=ids).logits[0, :-1].argmax(-1)
        mask = torch.tensor(loss_mask(s))[1:].bool()
        by_hand += bool((pred[mask] == ids[0, 1:][mask]).all())
    assert int(count) == 12 and int(right) == by_hand

    class Oracle(torch.nn.Module):
        """Logits that put all mass on the next gold token: what a perfect model predicts."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            out = self.inner(input_ids=input_ids)
            gold = torch.nn.functional.one_hot(input_ids[:, 1:], out.logits.shape[-1]).float() * 1e4
            out.logits = torch.cat([gold, out.logits[:, -1:]], 1)
            return out

    _, right, count = teacher_forced(Oracle(model), batches, _no_autocast)
    assert int(right) == int(count) == 12

    class HalfOracle(Oracle):
        """Right on every target except the verdict of every other sample: EM must count exactly half."""

        def forward(self, input_ids):
            out = super().forward(input_ids)
            for row in range(0, len(input_ids), 2):
                last = int((input_ids[row] != vocab[istree.PAD]).sum()) - 2  # predicts the final label
                out.logits[row, last] = -out.logits[row, last]
            return out

    _, right, count = teacher_forced(HalfOracle(model), batches, _no_autocast)
    assert int(count) == 12 and int(right) == 3 + 2  # odd rows of a batch of 7 and of 5


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from harness.training.trainer import train_one

    cfg = _tiny(tmp_path_factory.mktemp("tr"), arch="mamba", samples=640, eval_every=160)
    return cfg, train_one(cfg, progress=False)


def _rescore(path, sequences, task):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    vocab = {t: i for i, t in enumerate(task.vocab)}
    loss, right, count = teacher_forced(model, [batch_from_tokens(sequences, vocab, "cpu")], _no_autocast)
    return float(right / count), float(loss / count)


def test_the_papers_protocol_reports_the_last_validation_of_the_final_weights(run):
    cfg, res = run
    assert cfg.checkpoint == "last"
    curve = [r for r in res["curve"] if "eval_em" in r]
    assert [r["samples"] for r in curve] == [160, 320, 480, 640]
    assert res["teacher_forced_em"] == res["last_validation_em"] == curve[-1]["eval_em"]
    assert res["checkpoint_samples"] == 640 and "best_validation_em" not in res
    assert res["reported"].startswith("last validation (the paper's number)") and "test split" in res["reported"]
    # the saved checkpoint is the final one: re-scoring it gives the reported number and the last row's loss
    task = TrainTask(cfg)
    em, loss = _rescore(cfg.output, task.heldout(), task)
    assert em == pytest.approx(res["teacher_forced_em"])
    assert len({r["eval_loss"] for r in curve}) == len(curve)  # checkpoints differ: the loss tells them apart
    assert loss == pytest.approx(curve[-1]["eval_loss"], rel=1e-4)
    assert 0.0 <= res["accuracy"] <= 1.0 and "eval_seconds" in res  # the live evaluation ran too
    assert (Path(cfg.output) / "curves.png").stat().st_size > 5000
    logged = [json.loads(line) for line in open(Path(cfg.output) / "train_log.jsonl")]
    assert logged == res["curve"]
    assert logged[-1]["loss"] < logged[0]["loss"]


def test_a_best_checkpoint_is_chosen_on_validation_and_reported_on_the_disjoint_test_split(tmp_path):
    from harness.training.trainer import train_one

    cfg = _tiny(tmp_path, nodes=6, checkpoint="best", samples=480, eval_every=80, live_eval=False)
    task = TrainTask(cfg)
    test, validation = task.heldout(), task.validation()
    assert len(validation) > 0 and not {tuple(s) for s in test} & {tuple(s) for s in validation}
    res = train_one(cfg, progress=False)
    curve = [r for r in res["curve"] if "eval_em" in r]
    best = max(r["eval_em"] for r in curve)
    kept = max(r["samples"] for r in curve if r["eval_em"] == best)  # ties go to the later checkpoint
    assert res["checkpoint_samples"] == kept and res["best_validation_em"] == best
    assert res["last_validation_em"] == curve[-1]["eval_em"]
    assert "chosen on the validation split" in res["reported"] and "disjoint" in res["validation"]
    # the curve was measured on the validation split; the reported number on the test split, of the kept weights
    row = next(r for r in curve if r["samples"] == kept)
    val_em, val_loss = _rescore(cfg.output, validation, task)
    test_em, test_loss = _rescore(cfg.output, test, task)
    assert val_em == pytest.approx(row["eval_em"]) and val_loss == pytest.approx(row["eval_loss"], rel=1e-4)
    assert test_em == pytest.approx(res["teacher_forced_em"]) and test_loss != pytest.approx(val_loss, rel=1e-4)


def test_a_run_finished_before_the_protocol_is_not_taken_for_the_papers(run, tmp_path):
    import dataclasses
    import shutil

    from harness.training.trainer import train_one

    cfg, res = run
    old = tmp_path / "old"
    shutil.copytree(cfg.output, old)
    earlier = {k: v for k, v in res.items() if k != "checkpoint"}
    (old / "result.json").write_text(json.dumps(earlier))
    with pytest.raises(ConfigError, match="checkpoint: 'best on the reported samples"):
        train_one(dataclasses.replace(cfg, output=str(old)), progress=False)


def test_a_finished_run_is_reused_only_with_its_own_settings(run):
    from harness.training.trainer import train_one

    cfg, res = run
    assert train_one(cfg, progress=False) == res  # finished: returned, not retrained
    import dataclasses

    with pytest.raises(ConfigError, match="samples: 640 there, 1280 now"):
        train_one(dataclasses.replace(cfg, samples=1280), progress=False)


def test_tensorboard_tracker_gets_the_curves(tmp_path):
    pytest.importorskip("tensorboard")
    from harness.training.trainer import train_one

    cfg = _tiny(tmp_path, samples=64, eval_every=32, report_to="tensorboard", live_eval=False)
    res = train_one(cfg, progress=False)
    assert "accuracy" not in res and res["teacher_forced_em"] >= 0
    assert list((tmp_path / "run" / "tracker").rglob("events.out.tfevents.*"))


@pytest.mark.slow
def test_global_batch_is_split_over_processes(tmp_path):
    """Under two processes the batch is 64 (here 16) in all, not per process: the same number of steps."""
    out = tmp_path / "dp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "harness.train", "--size", "smoke", "--nodes", "4", "--samples", "64",
           "--batch-size", "16", "--eval-every", "32", "--eval-samples", "10", "--report-to", "none",
           "--no-live-eval", "--no-progress", "--output", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["processes"] == 2 and result["steps"] == 4 and result["batch_size"] == 16
    assert [r["samples"] for r in result["curve"] if "eval_em" in r] == [32, 64]
    assert result["teacher_forced_samples"] == 10  # the whole test split, both processes' shares
    best = tmp_path / "best"  # a best checkpoint is reported on the whole test split too (by the main process)
    cmd[cmd.index("--master_port") + 1] = str(_free_port())
    res = subprocess.run([*cmd[:-1], str(best), "--nodes", "6", "--checkpoint", "best"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert json.loads((best / "result.json").read_text())["teacher_forced_samples"] == 10


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ data
def test_worker_processes_draw_distinct_reproducible_batches():
    cfg = TrainConfig(nodes=6, setup="cot", report_to="none").resolved()
    ds = TrainingBatches(TrainTask(cfg), batch=8, seed=1, process=0)

    def first(n, workers, start=0):
        ds.start_pool = start
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        it = iter(loader)
        return [next(it)[0][0] for _ in range(n)]

    a, b = first(4, 2), first(4, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # reproducible
    rows = {tuple(r.tolist()) for batch in a for r in batch}
    assert len(rows) == 32  # the two workers never repeat each other's samples
    # the stream depends on neither the number of workers nor where it starts: a resumed run sees batch k
    assert all(torch.equal(x, y) for x, y in zip(a, first(4, 0)))
    assert all(torch.equal(x, y) for x, y in zip(a[2:], first(2, 3, start=2)))


def test_length_bucketing_cuts_padding_without_changing_samples():
    cfg = TrainConfig(nodes=8, setup="retrieval", report_to="none").resolved()
    plain = TrainingBatches(TrainTask(cfg), batch=8, seed=3, process=0, bucket=1)
    sorted_ = TrainingBatches(TrainTask(cfg), batch=8, seed=3, process=0, bucket=8)
    pa, pb = iter(plain), iter(sorted_)
    a = [batch for _ in range(8) for batch in next(pa)]
    b = next(pb)
    assert len(a) == len(b) == 8
    pad = TrainTask(cfg).vocab.index(istree.PAD)

    def multiset(batches):
        return sorted(tuple(t for t in r.tolist() if t != pad) for ids, _ in batches for r in ids)

    assert multiset(a) == multiset(b)  # the same 64 samples, batched differently
    padding = lambda bs: sum(int((ids == pad).sum()) for ids, _ in bs)  # noqa: E731
    assert padding(b) < 0.5 * padding(a)


# ------------------------------------------------------------------------------------------ config and CLI
def test_one_config_source_resolves_the_papers_defaults():
    cfg = TrainConfig(arch="mamba").resolved()
    assert (cfg.samples, cfg.batch_size, cfg.warmup, cfg.eval_every, cfg.eval_samples, cfg.lr) == \
        (5_000_000, 64, 10_000, 100_000, 5000, 3e-4)
    assert cfg.output == "runs/mamba-0.5M-n16-cot"
    assert TrainConfig(d_model=96, layers=3).resolved().name == "transformer-0.5M-d96-L3-n16-cot"
    with pytest.raises(ConfigError, match="--batch-size"):
        TrainConfig(batch_size=0).resolved()


def test_d_model_and_layers_override_the_size_table():
    m = build_model("hybrid", "smoke", 30, d_model=48, layers=3)
    assert m.config.hidden_size == 48 and len(m.backbone.layers) == 3
    t = build_model("transformer", "smoke", 30, layers=5)
    assert len(t.model.layers) == 5
    with pytest.raises(ValueError, match="--d-model"):
        build_model("mamba", "smoke", 30, d_model=30)


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["--batch-size", "0", "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch-size 0") and "Traceback" not in err
    assert main(["--plan", "--output", str(tmp_path / "y")]) == 2
    assert "--grid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--graph", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_plan_packs_cells_as_the_grid_runs_them():
    from harness.training.grid import _makespan

    assert _makespan([3, 2, 2, 1], 2) == 4 and _makespan([3, 2, 2, 1], 1) == 8 and _makespan([5, 1, 1], 4) == 5


def test_smoke_grid_cells_and_plan(tmp_path):
    from harness.training.grid import grid_cells, plan_grid

    cells = grid_cells("smoke", TrainConfig(), tmp_path)
    assert len(cells) == 9 and {c.nodes for c in cells} == {4}
    by = {(c.arch, c.setup): c for c in cells}
    assert by["mamba", "cot"].samples > by["mamba", "retrieval"].samples  # budgets per setup
    assert all(Path(c.output).parent == tmp_path for c in cells)
    # a flag given on the command line wins over the grid's default
    assert {c.lr for c in grid_cells("smoke", TrainConfig(lr=1e-3), tmp_path)} == {1e-3}
    table = plan_grid("smoke", TrainConfig(), tmp_path, measure_batch=2, steps=1, progress=False, jobs=2,
                      passes=2, live_samples=4)
    assert table.count("smoke-n4") == 9 and "2 at a time" in table and "of wall time" in table
    # its parts: how steps were timed, serial hours, the live evaluation timed on a retrieval cell, the data
    assert "median of 2 pass(es) over 1 batches" in table and "- serial: " in table
    assert "- live evaluation of the 3 retrieval cells: " in table and "timed on 4 test samples" in table
    assert "steps replayed over its test samples' traces" in table and " in static batches" in table
    assert "writing the gold traces" in table and "tool calls a sample, 100% right" in table
    assert "- data generation: inline" in table and "1M samples" not in table  # smoke runs are shorter
    assert not list(tmp_path.iterdir())  # planning trains and writes nothing


def test_grid_progress_counts_the_steps_each_cell_has_logged(tmp_path):
    from harness.training.grid import cell_fraction

    cell = TrainConfig(task="index", length=4, arch="mamba", size="smoke", samples=3200, batch_size=32,
                       output=str(tmp_path / "cell"))  # 100 steps
    assert cell_fraction(cell) == 0.0  # not started
    (tmp_path / "cell").mkdir()
    log = tmp_path / "cell" / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0, "pad": "x" * 300}) + "\n" for s in range(0, 40)))
    assert cell_fraction(cell) == 0.4  # the last line of a log longer than the tail it reads
    log.write_text(log.read_text() + '{"step": 4')  # a line being written: not counted, not an error
    assert cell_fraction(cell) == 0.4
    (tmp_path / "cell" / "result.json").write_text("{}")
    assert cell_fraction(cell) == 1.0


def test_the_grid_table_says_which_checkpoint_each_number_comes_from(tmp_path):
    """A finished cell of the paper's protocol and one finished before it (best checkpoint on the reported
    samples): both in one report, each labelled for what it is."""
    from harness.training.grid import write_grid_report

    common = {"task": "istree", "setup": "direct", "nodes": 4, "size": "smoke", "trainable_parameters": 1000,
              "samples": 6400, "final_loss": 0.5, "samples_per_second": 10.0, "train_seconds": 1.0,
              "accuracy": 0.5, "accuracy_se": 0.1, "curve": []}
    runs = {"transformer": {"teacher_forced_em": 0.75, "checkpoint": "last", "checkpoint_samples": 6400},
            "mamba": {"teacher_forced_em": 0.5, "best_samples": 3200}}  # written before the protocol
    for arch, fields in runs.items():
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "result.json").write_text(json.dumps({**common, "arch": arch, **fields}))
    table = write_grid_report(tmp_path)
    rows = {line.split("|")[4].strip(): line for line in table.splitlines() if line.startswith("| direct")}
    assert "| last " in rows["transformer"] and "6,400" in rows["transformer"] and "75.0" in rows["transformer"]
    assert "best on the reported samples (old run)" in rows["mamba"] and "3,200" in rows["mamba"]
    assert "TF EM (test)" in table and "the paper's protocol" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "istree_grid.png").stat().st_size > 5000
    (tmp_path / "mamba" / "result.json").unlink()  # only runs of the protocol: no old row to label
    assert "| last " in write_grid_report(tmp_path) and "old run" not in (tmp_path / "results.md").read_text()


def test_the_live_evaluation_projection_replays_the_loops_own_steps():
    """Rows are refilled as they finish, so a whole live evaluation is projected by replaying the loop's admission
    rule over every test sample's gold trace: on a timed run of three batches (rows refilled) the replay gives the
    run's own decode steps (else measure_live_eval raises), and it takes fewer steps than static batches would."""
    from harness.backends.generation import scheduled_steps
    from harness.training.grid import measure_live_eval

    cell = TrainConfig(arch="mamba", size="smoke", nodes=8, setup="retrieval", report_to="none",
                       eval_batch_size=4, eval_samples=40).resolved()
    m = measure_live_eval(cell, torch.device("cpu"), samples=12)
    assert m["samples"] == 12 and m["accuracy"] == 1.0 and m["decode_steps"] > 0
    assert 0 < m["run_s"] < m["static_run_s"] and m["s_per_sample"] == pytest.approx(m["run_s"] / 40)
    # the replay itself: rows of 5 passes at 2 slots, the third joining when the first ends
    assert scheduled_steps([5, 2, 5], 2) == 6 and scheduled_steps([5, 2, 5], 2, continuous=False) == 4 + 4
    assert scheduled_steps([3], 4) == 2 and scheduled_steps([1, 1], 1) == 0


def test_the_plans_bar_weighs_each_cell_by_what_measuring_it_costs(tmp_path):
    """A bar counting cells read an ETA many times too short: the paper grid's direct cells come first and measure
    in seconds, its n=64 retrieval cells last and in minutes."""
    from harness.training.grid import _measuring_cost, grid_cells

    cells = grid_cells("paper", TrainConfig(), tmp_path)
    weight = {c.name: _measuring_cost(c) for c in cells}
    heaviest, lightest = max(cells, key=lambda c: weight[c.name]), min(cells, key=lambda c: weight[c.name])
    assert (heaviest.setup, heaviest.nodes, heaviest.size) == ("retrieval", 64, "2M")
    assert (lightest.setup, lightest.nodes, lightest.size) == ("direct", 16, "0.5M")
    assert weight[heaviest.name] > 50 * weight[lightest.name]
