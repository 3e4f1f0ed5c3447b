"""The token store: samples generated once, exactly the task's own samples and loss masks, shared by every
run with the same data, visited in a seeded order that neither data workers nor a resume changes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from evals.synthetic import loss_mask
from harness.training import store as st
from harness.training.config import TrainConfig
from harness.training.data import TrainingBatches, TrainTask, batch_from_tokens

ROOT = Path(__file__).resolve().parent.parent


def _task(**kw):
    base = dict(arch="transformer", size="smoke", nodes=5, setup="retrieval", samples=320, batch_size=16,
                report_to="none")
    return TrainTask(TrainConfig(**{**base, **kw}).resolved())


def test_a_store_holds_the_tasks_own_samples_and_loss_masks(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "SHARD", 64)  # several shards, the last one short
    task = _task()
    store = st.ensure_store(task, 150, tmp_path)
    assert len(store) == 150 and store.meta["samples"] == 150
    key = st.store_key(task, 150)
    expected = []
    for shard in range(3):
        stream = task.impl.stream(seed=st.shard_seed(key, shard))
        expected += [next(stream) for _ in range(64)]
    expected = expected[:150]
    assert len({tuple(s) for s in expected}) > 100  # the samples vary
    vocab = {t: i for i, t in enumerate(task.vocab)}
    for i in (0, 63, 64, 149):
        assert store.sample(i).tolist() == [vocab[t] for t in expected[i]]
    picks = [3, 70, 149, 0]
    ids, mask = store.batch(picks)
    ref_ids, ref_mask = batch_from_tokens([expected[i] for i in picks], vocab, "cpu")
    assert torch.equal(ids, ref_ids) and torch.equal(mask, ref_mask)
    assert mask.sum() < mask.numel() and mask.sum() == sum(sum(loss_mask(expected[i])) for i in picks)


def test_runs_with_the_same_data_share_one_store_built_once(tmp_path):
    a = st.ensure_store(_task(arch="transformer"), 40, tmp_path)
    b = st.ensure_store(_task(arch="mamba", size="0.5M"), 40, tmp_path)  # another cell, same data
    assert a.path == b.path and len(list(tmp_path.iterdir())) == 2  # the store and its lock file
    built = (a.path / "tokens.bin").stat().st_mtime_ns
    assert (st.ensure_store(_task(), 40, tmp_path).path / "tokens.bin").stat().st_mtime_ns == built
    other = st.ensure_store(_task(nodes=6), 40, tmp_path)  # other data: another store
    assert other.path != a.path


@pytest.mark.slow
def test_workers_build_the_same_store_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "SHARD", 16)
    one = st.ensure_store(_task(), 50, tmp_path / "a")
    # a child process with two pool workers (spawned: SHARD is read from the module there, so set it there too)
    code = ("import sys; from harness.training import store as st; st.SHARD = 16; "
            "from tests.test_store import _task; s = st.ensure_store(_task(), 50, sys.argv[1], workers=2); "
            "print(s.path.name)")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    two = st.TokenStore(tmp_path / "b" / res.stdout.strip())
    assert two.path.name == one.path.name
    assert (one.path / "tokens.bin").read_bytes() == (two.path / "tokens.bin").read_bytes()
    assert (one.path / "masks.bin").read_bytes() == (two.path / "masks.bin").read_bytes()


@pytest.mark.parametrize("bucket", [1, 3])
def test_store_batches_are_seeded_resumable_and_epoch_ordered(tmp_path, bucket):
    task = _task()
    store = st.ensure_store(task, 48, tmp_path)
    whole = TrainingBatches(task, 8, seed=1, process=0, bucket=bucket, store=store)
    pools = [whole.pool(k) for k in range(8)]  # 8 pools x bucket x 8 samples: several epochs of 48
    resumed = TrainingBatches(task, 8, seed=1, process=0, bucket=bucket, store=store, start_pool=5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(pools[5], next(iter(resumed))))
    if bucket == 1:  # each epoch visits every sample once, in an order of its own
        seen = [whole._at(k) for k in range(96)]
        assert sorted(seen[:48]) == sorted(seen[48:]) == list(range(48)) and seen[:48] != seen[48:]
    other = TrainingBatches(task, 8, seed=2, process=0, bucket=bucket, store=store)
    assert not torch.equal(other.pool(0)[0][0], pools[0][0][0])
    # two processes take alternate batches of one global sequence: together, each sample once an epoch
    p0 = TrainingBatches(task, 4, seed=1, process=0, store=store, processes=2)
    p1 = TrainingBatches(task, 4, seed=1, process=1, store=store, processes=2)
    got = [p._at(k) for b in range(6) for p in (p0, p1) for k in range((b * 2 + p.process) * 4, (b * 2 + p.process + 1) * 4)]
    assert sorted(got) == list(range(48))


def test_training_from_a_store_records_which_data_it_read(tmp_path):
    from harness.training.trainer import train_one

    base = dict(arch="transformer", size="smoke", nodes=4, setup="direct", samples=256, batch_size=32, warmup=32,
                lr=3e-3, eval_every=64, eval_samples=16, eval_batch_size=16, report_to="none", live_eval=False,
                store=100, store_dir=str(tmp_path / "stores"))
    res = train_one(TrainConfig(**base, output=str(tmp_path / "a")).resolved(), progress=False)
    assert res["store"] == 100 and res["data"].startswith(str(tmp_path / "stores"))
    fresh = train_one(TrainConfig(**{**base, "store": None}, output=str(tmp_path / "b")).resolved(), progress=False)
    assert fresh["data"] == "fresh samples every step" and fresh["curve"] != res["curve"]
    assert json.loads((tmp_path / "a" / "result.json").read_text())["data"] == res["data"]


# ------------------------------------------------------------------ a store is the data it claims to be
def test_a_store_of_other_data_in_its_place_is_refused_by_the_cli(tmp_path, capsys):
    """A direct store copied where the cot store lives: the run refuses it (it would train on direct data)."""
    import shutil

    from harness.train import main as train_main

    direct = st.ensure_store(_task(setup="direct"), 40, tmp_path)
    cot_path = tmp_path / f"istree-{st.json_digest(st.store_key(_task(setup='cot'), 40))}"
    assert cot_path != direct.path
    shutil.copytree(direct.path, cot_path)
    rc = train_main(["--arch", "transformer", "--size", "smoke", "--nodes", "5", "--setup", "cot", "--samples", "64",
                     "--batch-size", "16", "--store", "40", "--store-dir", str(tmp_path), "--report-to", "none",
                     "--output", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: token store") and str(cot_path) in err and "setup" in err, err
    assert not (tmp_path / "run" / "train_log.jsonl").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "offsets", "meta-gone", "meta-vocab", "meta-list",
                                    "legacy-unhashed"])
def test_a_damaged_store_is_moved_aside_and_built_again(tmp_path, damage):
    task = _task()
    store = st.ensure_store(task, 60, tmp_path)
    good = {n: (store.path / n).read_bytes() for n in st.FILES}
    assert len(set(good["tokens.bin"])) > 3
    tokens = store.path / "tokens.bin"
    if damage == "truncate":  # the issue's `truncate -s -12 tokens.bin`
        os.truncate(tokens, tokens.stat().st_size - 12)
    elif damage == "flip":  # same size, other bytes: only the hash sees it
        raw = bytearray(tokens.read_bytes())
        raw[len(raw) // 2] ^= 1
        tokens.write_bytes(bytes(raw))
        os.utime(tokens, ns=(1, 1))  # an old mtime, as a file damaged long after its build
    elif damage == "offsets":
        np.save(store.path / "offsets.npy", np.arange(10))
    elif damage == "meta-vocab":  # meta.json edited: two tokens swapped (the store's key still matches its name)
        meta = json.loads((store.path / "meta.json").read_text())
        meta["vocab"][3], meta["vocab"][4] = meta["vocab"][4], meta["vocab"][3]
        (store.path / "meta.json").write_text(json.dumps(meta))
    elif damage == "meta-list":
        (store.path / "meta.json").write_text("[]")
    elif damage == "legacy-unhashed":  # a store of format 1, which recorded no hashes, rewritten at the same size
        meta = json.loads((store.path / "meta.json").read_text())
        for field in ("sha256", "meta_sha256"):
            del meta[field]
        (store.path / "meta.json").write_text(json.dumps({**meta, "format": 1}))
        tokens.write_bytes(bytes(tokens.stat().st_size))
    else:  # a folder without meta.json: a killed build's, never a store
        (store.path / "meta.json").unlink()
    again = st.ensure_store(task, 60, tmp_path)
    assert {n: (again.path / n).read_bytes() for n in st.FILES} == good  # rebuilt to the same bytes
    aside = list(tmp_path.glob(f"{store.path.name}.damaged-*"))
    assert len(aside) == (0 if damage == "meta-gone" else 1)  # the damaged store kept, not deleted


def test_a_killed_build_leaves_nothing_that_grows_and_stores_are_group_readable(tmp_path):
    task = _task()
    key = st.store_key(task, 30)
    name = f"{task.cfg.task}-{st.json_digest(key)}"
    for i in range(3):  # three builds killed with SIGKILL (their finally never ran)
        (tmp_path / f".building-{name}-{i}").mkdir()
        (tmp_path / f".building-{name}-{i}" / "tokens.bin").write_bytes(b"\0" * 100)
    old = os.umask(0o022)
    try:
        store = st.ensure_store(task, 30, tmp_path)
    finally:
        os.umask(old)
    assert not list(tmp_path.glob(".building-*"))
    assert store.path.stat().st_mode & 0o055 == 0o055  # group and others may read and enter it
    assert all((store.path / n).stat().st_mode & 0o044 == 0o044 for n in (*st.FILES, "meta.json"))


def test_a_store_is_keyed_by_its_vocabulary(tmp_path):
    """The generator's vocabulary reordered (an edit without a format bump): the old ids would be other tokens, so
    the run builds its own store; the old store copied into its place is refused, naming the vocabulary."""
    import shutil

    task = _task()
    old = st.ensure_store(task, 40, tmp_path)
    reordered = list(task.vocab)
    reordered[3], reordered[4] = reordered[4], reordered[3]
    assert reordered != list(task.vocab)
    task.vocab = reordered
    new_path = tmp_path / f"istree-{st.json_digest(st.store_key(task, 40))}"
    assert new_path != old.path
    shutil.copytree(old.path, new_path)
    with pytest.raises(st.StoreError, match=r"vocab differs \(first at id 3"):
        st.ensure_store(task, 40, tmp_path)
    shutil.rmtree(new_path)
    new = st.ensure_store(task, 40, tmp_path)
    assert new.vocab == reordered and new.path == new_path
    # the same samples (the seeds depend on what is drawn, not on the ids), written in the new vocabulary's ids
    assert [[new.vocab[i] for i in new.sample(k)] for k in range(5)] == \
        [[old.vocab[i] for i in old.sample(k)] for k in range(5)]
    assert any(not np.array_equal(new.sample(k), old.sample(k)) for k in range(5))
