"""A CPU's float32 attention in one pass: a causal block of queries after cached keys (``attention``) and a few
queries a row under an additive mask, decoding steps (``decode``: the merged rows' shared front read from one
row), by the flash attention kernels in ``cpu_flash_attention.cpp``, compiled here on first use and kept in the
cache folder.

Why by hand: on a CPU, PyTorch's attention makes the scores, adds the mask, takes the softmax and sums the values
as separate passes over a [queries, keys] matrix per head, too large for the core's cache (a 512-query chunk
over 2,000 keys: 4 MB a head), and its fused SDPA kernel goes through the BLAS (MKL's AVX2 code on an AMD CPU).
Neither PyTorch nor a well-kept package ships a fused CPU attention that skips a block's unseen keys after
cached ones (vLLM's is inside its own engine; inductor's FlexAttention template ran 1.4x slower than the
separate passes here). Measured on one layer's segments (4 heads of 64, 2 threads, AMD EPYC, AVX-512):
1,000 queries after 1,500 keys 5.8 ms against 8.1 through oneDNN's products, 1,600 after 774 7.3 against 11.2;
a decoding step of 24 merged rows (a front of 774, 2,500 keys) 2.2 ms against 3.0 by PyTorch's flash kernel
(``benchmarks/cpu_attention.py``).

The kernel is compiled with the machine's own vector width (``-march=native``), so the library is cached under a
key of its source, the compiler, the head size and this CPU's flags; no compiler, a failed build or a result
that differs from SDPA's (``checked.agrees``) leaves attention as it was, saying why once. So does a kernel
slower than SDPA here (``race_sdpa``, once a machine, kept in ``cpu-flash.json``): a build can be pathological
where its numbers are right (built for AVX2, before its vector loads were written as intrinsics, it moved every
vector through the stack in halves and ran a 1,600-query block in 303 ms against SDPA's 22 and its own 13 now).
``ICR_CPU_FLASH=off`` turns it off. Each query's tile and keys are fixed by its position, not by the number of
threads, so a result does not change with the thread count.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from harness.cache import MachineChoices, cache_dir, machine_key
from harness.ops.checked import agrees

log = logging.getLogger("harness")

SOURCE = Path(__file__).with_name("cpu_flash_attention.cpp")
ENV = "ICR_CPU_FLASH"  # "off" turns the kernel off
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
TOLERANCE = 1e-5  # against SDPA in float32, relative to the output's largest value (they round apart by ~1e-7)
PROBE_HEAD_DIM = 64  # the head size built to learn whether the kernel builds here at all (``identity``)
CALLS = {"attention": 0, "decode": 0}  # calls made, so a test can see the kernel ran
RACES = MachineChoices("cpu-flash.json", "whether the CPU flash attention kernel is faster than SDPA here")
RACE_REPEATS = 9  # timed calls of each, in turn; the fastest counts
DECODE_QUERIES = 32  # a decoding pass's queries a row and key head at most (the kernel's QUERIES)
_ARGS = ([ctypes.c_void_p] + [ctypes.c_long] * 3) * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + \
    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] + [ctypes.c_long] * 3 + \
    [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
_DECODE_ARGS = ([ctypes.c_void_p] + [ctypes.c_long] * 3) * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + \
    [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_int]


def enabled() -> bool:
    """Unless ``ICR_CPU_FLASH`` says ``off`` (or 0, false, no)."""
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def available(head_dim: int) -> bool:
    """Whether attention with heads of ``head_dim`` may take the kernel: turned on, a multiple of 16 up to 256,
    and built and checked here (once a process and head size)."""
    return enabled() and head_dim % 16 == 0 and head_dim <= 256 and _library(head_dim) is not None


def identity(device: torch.device, dtype: torch.dtype) -> dict:
    """What a run's settings hold of the kernel, decided before the model loads (it rounds apart from SDPA): its
    source's hash where a float32 run on a CPU may take it (turned on, and it builds here: ``PROBE_HEAD_DIM``
    tried), else nothing. The machine's, not the model's, as with the linear kernel: a model whose heads cannot
    take it is recorded with it all the same, so a run and its resume always agree."""
    if device.type != "cpu" or dtype != torch.float32 or not available(PROBE_HEAD_DIM):
        return {}
    return {"attention": f"CPU flash attention {hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"}


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              pads: list[list[tuple[int, int]]], scale: float) -> torch.Tensor:
    """[b, q, heads, d] causal attention of [b, heads, q, d] float32 queries, the block's last q positions, to
    [b, kv heads, kv, d] keys and values: query i sees key j iff j <= kv - q + i, and over each row's ``pads``
    (runs of key positions, [lo, hi)) the additive [b, 1, q, kv] ``mask`` is added to its scores (a mask that
    is 0 everywhere else it is seen: ``additive_mask``'s). Call ``available`` first."""
    with torch.profiler.record_function("icr::cpu_flash_attention"):  # a profile's event (no ATen op runs it)
        out = _run(_library(query.shape[-1]), query, key, value, mask, pads, scale)
    CALLS["attention"] += 1
    return out


def decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, shared: int,
           scale: float, middles: Middles | None = None) -> torch.Tensor:
    """[b, q, heads, d] attention of a few float32 queries a row (decoding steps) to all of [b, kv heads, kv, d]
    keys and values under an additive [b, 1, q, kv] ``mask`` (None: every key seen), the first ``shared`` keys
    read from the first row (every row holds the same there: the rows a prefix tree merged), and each group of
    ``middles`` (rows sharing more than the front) reading its middle once for all its rows. One pass a row (or
    group) and head over keys and values, an online softmax, 16 keys at a time. Call ``available`` first."""
    with torch.profiler.record_function("icr::cpu_flash_attention_decode"):
        out = _decode(_library(query.shape[-1]), query, key, value, mask, shared, scale, middles)
    CALLS["decode"] += 1
    return out


def _decode(lib, query, key, value, mask, shared, scale, middles=None) -> torch.Tensor:
    b, heads, q, _ = query.shape
    if heads // key.shape[1] * q > DECODE_QUERIES:
        raise ValueError(f"the decoding pass takes {DECODE_QUERIES} queries a row and key head at most, not "
                         f"{heads // key.shape[1] * q}")
    query, key, value = (_last_contiguous(x) for x in (query, key, value))
    out = query.new_empty(b, q, heads, value.shape[-1])
    masked = _checked(mask) if mask is not None else None
    if middles is not None and (middles.owner.shape[0] != b or middles.shared != shared or middles.last > key.shape[2]):
        raise ValueError(f"middles for {middles.owner.shape[0]} rows after {middles.shared} keys, up to {middles.last}: "
                         f"not this step's {b} rows after {shared}, of {key.shape[2]} keys")
    owner, end = (None, None) if middles is None else (middles.owner, middles.end)
    lib.icr_decode_attention(*_strided(query), *_strided(key), *_strided(value),
                             *((masked.data_ptr(), masked.stride(0), masked.stride(2)) if masked is not None
                               else (None, 0, 0)),
                             *_strided(out), b, heads, key.shape[1], q, key.shape[2], shared,
                             None if owner is None else owner.data_ptr(), None if end is None else end.data_ptr(),
                             scale, torch.get_num_threads())
    return out


@dataclass(frozen=True)
class Middles:
    """Rows of a batch that share more than its front (``decode``): row r holds row ``owner[r]``'s keys from the
    front's end to ``end[owner[r]]``. Made by ``of``, which checks what the kernel relies on."""

    owner: torch.Tensor  # int32 [rows]
    end: torch.Tensor  # int32 [rows]
    shared: int  # the front they follow
    last: int  # the largest end

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]], shared: int) -> "Middles":
        """From each row's (owner, end): an owner at or before its row and its own owner, a group's rows
        consecutive, ends from ``shared`` on."""
        owner = [o for o, _ in pairs]
        for r, (o, e) in enumerate(pairs):  # a row owns its group, or is in the group of the row before it
            if not ((o == r or (r > 0 and o == owner[r - 1])) and e >= shared):
                raise ValueError(f"middles: row {r}'s owner {o} and end {e} are not a run of rows after a front of "
                                 f"{shared} (owners at or before their rows, each its own, groups consecutive)")
        return cls(torch.tensor(owner, dtype=torch.int32), torch.tensor([e for _, e in pairs], dtype=torch.int32),
                   shared, max((e for _, e in pairs), default=shared))

    def select(self, keep: Sequence[int]) -> "Middles | None":
        """The middles of rows ``keep`` (the rows a batch keeps, in order): each group's first kept row its owner
        (every row of a group holds the middle); None where no group is left, or the order breaks a group."""
        owner, end = self.owner.tolist(), self.end.tolist()
        first: dict[int, int] = {}
        pairs = [(first.setdefault(owner[b], i), end[owner[b]]) for i, b in enumerate(keep)]
        if all(o == i for i, (o, _) in enumerate(pairs)):
            return None
        try:
            return Middles.of(pairs, self.shared)
        except ValueError:  # rows reordered: each reads its own middle, as without
            return None


def _run(lib, query, key, value, mask, pads, scale) -> torch.Tensor:
    b, heads, q, d = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    query, value = _last_contiguous(query), _last_contiguous(value)
    width = -(-keys // 16) * 16  # the kernel reads the transposed keys 16 at a time
    keys_t = key.new_empty(b, kv_heads, d, width)
    keys_t[..., :keys] = key.transpose(-1, -2)
    keys_t[..., keys:] = 0  # read, never used
    most = max((len(p) for p in pads), default=0)
    runs = torch.zeros(b, max(most, 1), 2, dtype=torch.int32)
    for row, spans in enumerate(pads):
        if spans:
            runs[row, :len(spans)] = torch.tensor(spans, dtype=torch.int32)
    counts = torch.tensor([len(p) for p in pads], dtype=torch.int32)
    mask = _checked(mask) if mask is not None and most else query.new_zeros(1, 1, 1, 1)  # never read without pads
    out = query.new_empty(b, q, heads, value.shape[-1])
    lib.icr_flash_attention(*_strided(query), *_strided(keys_t), *_strided(value),
                            mask.data_ptr(), mask.stride(0), mask.stride(2), runs.data_ptr(), counts.data_ptr(),
                            runs.shape[1], *_strided(out), b, heads, kv_heads, q, keys, scale,
                            torch.get_num_threads())
    return out


def _strided(x: torch.Tensor) -> tuple:
    """A 4D tensor as the kernels take it: its address and its first three strides (the last is 1)."""
    return x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _checked(mask: torch.Tensor) -> torch.Tensor:
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.stride(-1) != 1:
        raise ValueError(f"the mask must be [rows, 1, queries, keys] with contiguous keys, not {tuple(mask.shape)}")
    return mask


@functools.cache
def _library(head_dim: int) -> ctypes.CDLL | None:
    """The kernel for ``head_dim`` built (or found built) and checked against SDPA; None, said once, where not."""
    try:
        built = _built(head_dim)
        lib = load(built)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("the CPU flash attention kernel is not available here (%s); attention runs as before",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None
    if lib.icr_flash_head_dim() != head_dim:
        log.warning("the CPU flash attention kernel built for head size %d reports %d; not used", head_dim,
                    lib.icr_flash_head_dim())
        return None
    if not agrees(lambda: _check(lib, head_dim), TOLERANCE, "CPU flash attention kernel", "SDPA", "cpu",
                  f"the CPU (head size {head_dim})", "attention runs as before"):
        return None
    race = RACES.recall(f"{machine_key()} | {built.name}", lambda: _raced_thrice(lib, head_dim), _raced)
    if not race["faster"]:
        log.warning("the CPU flash attention kernel (head size %d) is slower than SDPA on this CPU (%s); attention "
                    "runs as before", head_dim, race["why"])
        return None
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library, its functions' C types declared."""
    lib = ctypes.CDLL(str(path))
    lib.icr_flash_attention.argtypes, lib.icr_decode_attention.argtypes = _ARGS, _DECODE_ARGS
    lib.icr_flash_attention.restype = lib.icr_decode_attention.restype = None
    return lib


def race_sdpa(lib, head_dim: int) -> dict:
    """Whether the kernel ``lib`` attends faster than SDPA on this machine: a block of 256 queries after 512 cached
    keys (a prefix tree's segment), 4 heads, each timed ``RACE_REPEATS`` times in turn, the fastest of each, on one
    thread and in the thread's own CPU time. What the race tells apart is the code a build made; time another
    process takes on the cores is not the build's (in CI, beside two test workers and the vLLM tests, a race by
    the clock read 0.48x where the kernel runs at 2x)."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 256, head_dim, generator=gen)
    key, value = (torch.randn(1, 4, 768, head_dim, generator=gen) for _ in range(2))
    mask = torch.full((256, 768), torch.finfo(torch.float32).min).triu_(513)[None, None]
    best = {"kernel": float("inf"), "sdpa": float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(RACE_REPEATS):
                for name in best:
                    start = time.thread_time()
                    if name == "kernel":
                        _run(lib, query, key, value, mask, [[]], head_dim ** -0.5)
                    else:
                        torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
                    best[name] = min(best[name], time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    ratio = best["sdpa"] / best["kernel"]
    return {"faster": ratio > 1.0, "why": f"SDPA's time over the kernel's {ratio:.2f}x on 256 queries after 512 keys, "
                                          "one thread"}


def _raced_thrice(lib, head_dim: int) -> dict:
    """``race_sdpa``, raced again where the kernel lost, up to three times: a loss is remembered for the machine, so
    it is taken only when every race says so (a build that is really slower loses every time)."""
    races = []
    for _ in range(3):
        races.append(race_sdpa(lib, head_dim))
        if races[-1]["faster"]:
            break
    return races[-1]


def _raced(race) -> bool:
    return isinstance(race, dict) and isinstance(race.get("faster"), bool) and isinstance(race.get("why"), str)


def _check(lib, head_dim: int):
    """The kernel and SDPA on one case of each kind it meets: two rows, one left-padded, grouped heads, a block
    after cached keys whose length is no multiple of the kernel's tiles."""
    def sdpa(query, key, value, mask, scale):  # [b, q, heads, d], the grouped key heads repeated
        group = query.shape[1] // key.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=mask,
            scale=scale).transpose(1, 2)

    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, q, keys = 2, 4, 2, 37, 300
    query, key, value = (torch.randn(b, n, length, head_dim, generator=gen)
                         for n, length in ((heads, q), (kv_heads, keys), (kv_heads, keys)))
    padding = torch.ones(b, keys, dtype=torch.bool)
    padding[1, :40] = False
    seen = padding[:, None, None, :] & torch.ones(q, keys, dtype=torch.bool).tril(keys - q)
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)
    pads = [[], [(0, 40)]]
    with torch.no_grad():
        ours = _run(lib, query, key, value, mask, pads, head_dim ** -0.5)
        theirs = sdpa(query, key, value, mask, head_dim ** -0.5)
        # decoding steps: three rows merged behind a shared front of 100 keys, the second padded after it
        key, value = (torch.cat([x[:1, :, :100].expand(3, -1, -1, -1), torch.randn(3, kv_heads, 150, head_dim,
                                                                                   generator=gen)], 2)
                      for x in (key, value))
        query = torch.randn(3, heads, 2, head_dim, generator=gen)
        step_mask = torch.zeros(3, 1, 2, 250)
        step_mask[1, ..., 100:120] = torch.finfo(torch.float32).min
        step_mask[:, :, 0, -1] = torch.finfo(torch.float32).min
        ours_step = _decode(lib, query, key, value, step_mask, 100, 0.3)
        theirs_step = sdpa(query, key, value, step_mask, 0.3)
        # the last two rows also share keys 100-179 (a middle), read once for both
        key, value = (x.clone() for x in (key, value))
        key[2, :, 100:180], value[2, :, 100:180] = key[1, :, 100:180], value[1, :, 100:180]
        middles = Middles.of([(0, 100), (1, 180), (1, 180)], 100)
        ours_middle = _decode(lib, query, key, value, step_mask, 100, 0.3, middles)
        theirs_middle = sdpa(query, key, value, step_mask, 0.3)
    return [ours, ours_step, ours_middle], [theirs, theirs_step, theirs_middle]


def _built(head_dim: int) -> Path:
    """The shared library for ``head_dim``: from the cache folder, else compiled into it (atomically)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (install g++, or name one in CXX)")
    version = _version(compiler)
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), str(head_dim),
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_flash_attention-d{head_dim}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, f"-DHEAD_DIM={head_dim}", str(SOURCE), "-o", str(built)],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip() or done.stdout.strip()}")
        os.replace(built, target)
    log.info("compiled the CPU flash attention kernel (head size %d) in %.1f s: %s", head_dim,
             time.perf_counter() - t0, target)
    return target


@functools.cache
def _version(compiler: str) -> str:
    """What ``compiler --version`` prints (once a process: every head size's build key holds it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout


def _cpu_flags() -> str:
    """This CPU's instruction sets (what ``-march=native`` compiles for), so a shared cache folder never hands one
    machine another's build."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
