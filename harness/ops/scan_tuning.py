"""The Triton scan's tile chosen by timing the candidates on the GPU at hand, once per class of launch, and
remembered on disk.

Why: which tile is fastest depends on the GPU and the shape, not only on the channels ``scan_triton.TILES`` reads.
Cutting time in splits (``scan_triton_steps``) pays where a row's programs leave the SMs idle: few rows, few
channel blocks, many SMs, long rows. So on a GPU each class of launch (GPU, precision, rows, channels, states,
length up to a power of two, restarts, skip, gate) times its candidates (both layouts' table tiles in 1, 2, 4 and
8 splits of at least two chunks each) forward and backward at its first shape and takes the fastest. This is
``triton.autotune``'s idea, written here because one tile is a launch of up to four kernels (the splits' side
passes and the main kernel, forward and backward) timed together, which autotune's per-kernel configs cannot
express. Choices are remembered in the harness's cache (``scan-tiles.json``, by GPU, Triton and torch): a rerun,
a resumed run or another cell of a grid takes the tile the first one took, so runs stay reproducible bit for bit
on one machine (tiles sum in other orders: within ``scan_triton.TOLERANCE`` of one another). ``ICR_SCAN_TILE=table``
keeps the table's tiles; a ``scan_triton.tiled`` block (benchmarks, the quick suite) sets the tile itself."""
from __future__ import annotations

import functools
import logging
import math
import os
import time

import torch
import triton

from harness.cache import MachineChoices
from harness.ops import scan_triton

log = logging.getLogger("harness")

SPLITS = (1, 2, 4, 8)  # the split counts tried of each layout's table tile
REPEATS = 3  # timed forward+backward passes a candidate, after one warm-up (its compile); the fastest counts
_chosen: dict[tuple, tuple] = {}  # this process's choices, by their launch class's fields
CHOICES = MachineChoices("scan-tiles.json", "the Triton scan's tiles")


def candidates(shape: tuple[int, int, int], states: int) -> list[tuple]:
    """The tiles a scan of ``u`` of ``shape`` (b, d, l) tries: each layout's table tile in each of ``SPLITS``
    splits that leaves every split two chunks or more, counted as ``splits_of`` launches them (no count twice),
    that fits 32-bit indexing."""
    tiles = []
    for tile in scan_triton.table_tiles(shape[1]):
        n_chunks = math.ceil(shape[2] / tile[1])
        for wanted in SPLITS:
            splits = scan_triton.splits_of(n_chunks, wanted)[1]
            choice = (*tile[:4], splits)
            if (splits == 1 or n_chunks >= 2 * splits) and choice not in tiles and scan_triton.fits(shape, states,
                                                                                                   choice):
                tiles.append(choice)
    return tiles


def launch_class(shape: tuple[int, int, int], device: torch.device, dtype: str, states: int, skip: bool,
                 gate: bool, resets: bool) -> str:
    """The key a choice is remembered by: the GPU and the builds that compile for it, the precision, rows,
    channels, states, the length rounded up to a power of two, the launch's flags, and what is tried (a table
    that changes is timed again)."""
    b, d, length = shape
    tries = " or ".join(scan_triton.tile_name(t) for t in scan_triton.table_tiles(d))
    return (f"{_device_name(device)} | triton {triton.__version__} torch {torch.__version__} | {dtype} | rows {b} "
            f"channels {d} states {states} steps <= {triton.next_power_of_2(length)} | skip {skip} gate {gate} "
            f"resets {resets} | tries {tries} in {'/'.join(map(str, SPLITS))} splits")


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} (Triton's interpreter)"


def tile_for(shape: tuple[int, int, int], device: torch.device, dtype: str, states: int, skip: bool = True,
             gate: bool = True, resets: bool = False) -> tuple[tuple, bool]:
    """(tile, tuned) for a Triton scan of ``u`` of ``shape``: the tile a ``scan_triton.tiled`` block sets;
    else the table's where tiles are not timed (``ICR_SCAN_TILE``: ``table``; unset, on a CPU, where the scan
    runs only in Triton's interpreter for tests; ``timed`` times them there too) or while a CUDA graph is
    captured (nothing can be timed); else the fastest candidate of its launch class, remembered or timed now."""
    d = shape[1]
    how = os.environ.get("ICR_SCAN_TILE") or ("timed" if device.type == "cuda" else "table")
    if how not in ("timed", "table"):
        raise ValueError(f"ICR_SCAN_TILE={how!r}: use timed or table (or leave it unset)")
    if scan_triton.forced() or how == "table":
        return scan_triton.current_tile(d), False
    # every Mamba layer of every forward asks: its class's tile is looked up by the class's fields, and its key
    # (a string) made only once
    fields = (shape[0], d, triton.next_power_of_2(shape[2]), device, dtype, states, skip, gate, resets)
    if fields not in _chosen:
        key = launch_class(shape, device, dtype, states, skip, gate, resets)
        remembered = _usable(CHOICES.read().get(key), shape, states)
        if remembered is not None:
            _chosen[fields] = remembered
        elif device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return scan_triton.current_tile(d), False
        else:
            _chosen[fields] = _tune(key, shape, device, dtype, states, skip, gate, resets)
    return _chosen[fields], True


def _tune(key: str, shape, device, dtype: str, states: int, skip: bool, gate: bool, resets: bool) -> tuple:
    """The fastest of ``candidates`` forward and backward on random inputs of ``shape``, remembered on disk."""
    tiles = candidates(shape, states)
    if len(tiles) <= 1:  # nothing to choose (none: the shape does not fit, and the scan runs on PyTorch)
        return tiles[0] if tiles else scan_triton.current_tile(shape[1])
    ms, failed = {}, {}
    # timed as a training step runs it, from inside any pass: an evaluation's inference mode, autocast
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        try:
            inputs = _inputs(shape, device, getattr(torch, dtype), states, skip, gate, resets)
        except torch.cuda.OutOfMemoryError:
            log.warning("Triton scan, %s: no memory to time its tiles beside the run's; the table's tile runs", key)
            return scan_triton.current_tile(shape[1])
        for tile in tiles:
            try:
                ms[scan_triton.tile_name(tile)] = _time(tile, inputs, device)
            # a candidate that cannot run here (its arrays beside the run's, a GPU's resources) is not chosen
            except Exception as e:  # noqa: BLE001
                failed[scan_triton.tile_name(tile)] = f"{type(e).__name__}: {e}"[:200]
        del inputs
    if not ms:
        log.warning("Triton scan, %s: no tile ran (%s); the table's tile runs", key, failed)
        return scan_triton.current_tile(shape[1])
    best = min((t for t in tiles if scan_triton.tile_name(t) in ms), key=lambda t: ms[scan_triton.tile_name(t)])
    log.info("Triton scan, %s: tile %s (forward+backward ms: %s)%s", key, scan_triton.tile_name(best),
             ", ".join(f"{name} {v:.3g}" for name, v in ms.items()), f"; could not run: {failed}" if failed else "")
    return _remember(key, {"tile": list(best), "ms": ms, **({"failed": failed} if failed else {})}, shape, states)


def _inputs(shape, device, act: torch.dtype, states: int, skip: bool, gate: bool, resets: bool) -> list:
    """The device check's random inputs (``scan_triton.random_inputs``) on ``device``, and packed rows' starts."""
    g = torch.Generator().manual_seed(0)
    inputs = [t.to(device) if t is not None else None
              for t in scan_triton.random_inputs(shape, states, act, skip, gate, g)]
    starts = (torch.rand(shape[0], shape[2], generator=g) < 0.002).float().to(device) if resets else None
    return [*inputs, starts]


def _time(tile: tuple, inputs: list, device: torch.device) -> float:
    """Milliseconds of the fastest of ``REPEATS`` forward+backward passes on ``tile``, after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = math.inf
    for i in range(REPEATS + 1):
        leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs[:7]]
        sync()
        start = time.perf_counter()
        y = scan_triton.TritonScan.apply(*leaves, inputs[7], tile)
        torch.autograd.grad(y.float().sum(), [t for t in leaves if t is not None])
        sync()
        if i:
            best = min(best, 1e3 * (time.perf_counter() - start))
    return best


def _usable(entry, shape: tuple[int, int, int], states: int) -> tuple | None:
    """A remembered entry's tile, if it is still one this version of the table tries and fits ``shape`` (a file
    written before the table changed, or edited by hand, is timed again)."""
    try:
        tile = tuple(entry["tile"])
        layouts = {t[:4] for t in scan_triton.table_tiles(shape[1])}
        ok = (tile[:4] in layouts and isinstance(tile[4], int) and tile[4] >= 1
              and scan_triton.fits(shape, states, tile))
    except (TypeError, KeyError, IndexError, ValueError):
        return None
    return tile if ok else None


def _remember(key: str, choice: dict, shape: tuple[int, int, int], states: int) -> tuple:
    """Adds a choice to the file; the tile that stands: one another process remembered first, else this one."""
    return tuple(CHOICES.remember(key, choice, lambda entry: _usable(entry, shape, states) is not None)["tile"])
