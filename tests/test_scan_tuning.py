"""The Triton scan's tile timed per launch class and remembered (``harness/ops/scan_tuning.py``): in Triton's CPU
interpreter, in a child process (``TRITON_INTERPRET=1`` must be set before triton is imported). A class is timed
once and its choice read back from the cache file by the next process, untouched; a run takes the tile its choice
names, equal to the step-by-step scan on every candidate; a file that cannot be read is timed again and
rewritten; the table's tile where tiles are not timed; two processes timing at once lose no class. The
candidates themselves are arithmetic."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, logging, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from harness.ops import scan_triton as st, scan_tuning as tuning, selective_scan as ss

    st.TILES = ((None, ("chunks", 8, 4, 1, 1)),)  # one layout, chunks of 8: 32 steps run in 1 or 2 splits
    tuning.REPEATS = 1
    warned = []
    logging.getLogger("harness").addHandler(type("H", (logging.Handler,), {
        "emit": lambda self, r: warned.append(r.getMessage()) if r.levelno >= logging.WARNING else None})())
    shape, dev, out = (2, 6, 32), torch.device("cpu"), {}
    out["candidates"] = tuning.candidates(shape, 3)

    os.environ["ICR_SCAN_TILE"] = "timed"
    out["first"] = tuning.tile_for(shape, dev, "float32", 3)
    file = tuning.CHOICES.file
    out["remembered"], remembered = json.loads(file.read_text()), json.loads(file.read_text())
    # the next process: nothing in memory, the file holding the other candidate as this machine's choice
    key = next(iter(remembered))
    remembered[key]["tile"] = [c for c in out["candidates"] if tuple(c) != tuple(out["first"][0])][0]
    file.write_text(json.dumps(remembered))
    text, stamp = file.read_text(), file.stat().st_mtime_ns
    tuning._chosen.clear()
    out["second"] = tuning.tile_for(shape, dev, "float32", 3)
    out["untouched"] = file.read_text() == text and file.stat().st_mtime_ns == stamp
    out["stale_usable"] = tuning._usable({"tile": ["chunks", 64, 4, 1, 1]}, shape, 3)

    # each candidate as a choice names it, through run_scan: the step-by-step scan's output and gradients; the
    # split tile launches its side passes, one split none
    launched, side = [], st._split_ends_forward
    class Counted:
        def __getitem__(self, grid):
            launched.append(grid[2])
            return side[grid]
    st._split_ends_forward = Counted()
    g = torch.Generator().manual_seed(5)
    b, d, length = shape
    u, z = torch.randn(b, length, d, generator=g).transpose(1, 2), torch.randn(b, d, length, generator=g)
    dt = torch.randn(b, d, length, generator=g) * 0.5
    B, C, w = torch.randn(b, 3, length, generator=g), torch.randn(b, 3, length, generator=g), torch.randn(b, d, length)
    A, D, bias = -torch.rand(d, 3, generator=g) * 2 - 0.5, torch.randn(d, generator=g), torch.randn(d, generator=g)
    out["runs"] = []
    for tile in [None, *out["candidates"]]:
        ins = [t.clone().requires_grad_() for t in (u, dt, A, B, C, D, z)]
        if tile is None:
            y = ss.sequential_scan(*ins, delta_bias=bias, delta_softplus=True)
        else:
            choice = ss.ScanChoice("triton", "cpu", "float32", 3, tile=tuple(tile))
            y = ss.run_scan(choice, *ins, delta_bias=bias, delta_softplus=True)
        got = [y.detach(), *torch.autograd.grad(y, ins, w)]
        if tile is None:
            ref = got
        out["runs"].append({"tile": tile, "varies": float(y.std()), "side_passes": len(launched),
                            "worst": max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref))})
        launched.clear()
    st._split_ends_forward = side

    # a file that is not JSON: timed again (with a warning) and rewritten
    file.write_text("{not json")
    tuning._chosen.clear()
    out["after_garbage"] = tuning.tile_for(shape, dev, "float32", 3)
    out["rewritten"] = json.loads(file.read_text())
    out["warned"] = warned

    # not timed: ICR_SCAN_TILE=table, a tiled block, an unknown setting
    os.environ["ICR_SCAN_TILE"] = "table"
    out["table"] = tuning.tile_for((2, 6, 100), dev, "float32", 3)
    os.environ["ICR_SCAN_TILE"] = "timed"
    with st.tiled("chunks", 8, 2, 1, 3):
        out["tiled"] = tuning.tile_for((2, 6, 100), dev, "float32", 3)
    os.environ["ICR_SCAN_TILE"] = "fastest"
    try:
        tuning.tile_for(shape, dev, "float32", 3)
    except ValueError as e:
        out["bad_setting"] = str(e)
    out["json"] = ss.ScanChoice("triton", "cuda", "bfloat16", 16, True, "triton", ("steps", 16, 16, 1, 4),
                                True).to_json()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_a_launch_class_is_timed_once_remembered_and_run_on_the_tile_it_names(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "ICR_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    one, two = ["chunks", 8, 4, 1, 1], ["chunks", 8, 4, 1, 2]
    assert out["candidates"] == [one, two]  # 4 chunks: 1 or 2 splits (4 and 8 would leave a split one chunk)
    tile, timed = out["first"]
    assert tile in (one, two) and timed is True
    (key, entry), = out["remembered"].items()
    assert "rows 2 channels 6 states 3 steps <= 32" in key and "float32" in key and "interpreter" in key
    assert entry["tile"] == tile and set(entry["ms"]) == {"chunks 8/4/1", "chunks 8/4/1 in 2 splits"}
    assert all(ms > 0 for ms in entry["ms"].values())
    # read back, not timed again: the file's choice, the file untouched
    assert out["second"] == [[c for c in (one, two) if c != tile][0], True] and out["untouched"] is True
    assert out["stale_usable"] is None  # a tile this table does not try: timed again
    reference, *runs = out["runs"]
    assert reference["varies"] > 0.1
    assert [(r["tile"], r["side_passes"]) for r in runs] == [(one, 0), (two, 1)]
    assert all(r["worst"] < 1e-5 for r in runs), runs
    assert out["after_garbage"][0] in (one, two) and out["after_garbage"][1] is True
    assert list(out["rewritten"]) == [key] and "cannot be read" in " ".join(out["warned"])
    assert out["table"] == [one, False] and out["tiled"] == [["chunks", 8, 2, 1, 3], False]
    assert "ICR_SCAN_TILE='fastest'" in out["bad_setting"]
    assert out["json"]["tile"] == "steps 16/16/1 in 4 splits" and "timing" in out["json"]["tile_chosen_by"]


def test_the_candidates_are_each_layouts_table_tile_in_splits_of_two_chunks_or_more(monkeypatch):
    from harness.ops import scan_triton as st
    from harness.ops import scan_tuning as tuning

    long = tuning.candidates((64, 128, 2535), 16)  # the 0.5M Mamba at n=64 retrieval: chunks first
    assert long[0] == st.table_tiles(128)[0] and {t[:4] for t in long} == {t[:4] for t in st.table_tiles(128)}
    assert sorted(t[4] for t in long) == [1, 1, 2, 2, 4, 4, 8, 8]
    assert tuning.candidates((64, 256, 2535), 16)[0][0] == "steps"  # the 1M and 2M models' table tile first
    # 48 tokens: one chunk of 64, three of 16: one split each
    assert [t[4] for t in tuning.candidates((64, 128, 48), 16)] == [1, 1]
    for shape in ((64, 128, 2535), (8, 256, 615), (3, 20, 100)):
        for layout, chunk, _, _, splits in tuning.candidates(shape, 16):
            per_split, launched = st.splits_of(-(-shape[2] // chunk), splits)
            assert launched == splits and (splits == 1 or per_split >= 2)
    # a launch class is its GPU, builds, precision, rows, channels, states, length up to a power of two and flags
    import torch

    cpu = torch.device("cpu")
    key = tuning.launch_class((64, 128, 1100), cpu, "bfloat16", 16, True, True, False)
    assert key == tuning.launch_class((64, 128, 2048), cpu, "bfloat16", 16, True, True, False)
    assert key != tuning.launch_class((64, 128, 2049), cpu, "bfloat16", 16, True, True, False)
    assert key != tuning.launch_class((64, 128, 1100), cpu, "bfloat16", 16, True, True, True)
    # a table that changes is a new class: its choices are timed again
    monkeypatch.setattr(st, "TILES", ((None, ("chunks", 32, 4, 1, 1)),))
    assert key != tuning.launch_class((64, 128, 1100), cpu, "bfloat16", 16, True, True, False)


RACER = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["ICR_SCAN_TILE"] = "timed"
    import torch
    from harness.ops import scan_triton as st, scan_tuning as tuning

    st.TILES = ((None, ("chunks", 8, 4, 1, 1)),)
    tuning.REPEATS = 1
    shapes = [(2, 6, 32), (1, 6, 40)] if sys.argv[1] == "a" else [(1, 6, 40), (2, 6, 32)]
    print(json.dumps({str(s): tuning.tile_for(s, torch.device("cpu"), "float32", 3)[0] for s in shapes}))
""")


@pytest.mark.slow
def test_two_processes_timing_at_once_keep_both_classes_and_one_tile_each(tmp_path):
    """Two processes time two classes at once, in opposite orders, into one cache: the file keeps both classes
    (merged under its lock, no update lost) and both processes run each class on the tile the file holds."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "ICR_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, who], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO) for who in ("a", "b")]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    remembered = json.loads((tmp_path / "scan-tiles.json").read_text())
    assert len(remembered) == 2 and a == b, (a, b, remembered)
    held = {("rows 2" if "rows 2 " in key else "rows 1"): entry["tile"] for key, entry in remembered.items()}
    assert held == {"rows 2": a["(2, 6, 32)"], "rows 1": a["(1, 6, 40)"]}
