"""CUDA graphs, written once for the three places that replay them (Phi-Mamba's and transformers' decode steps,
the trainer's optimizer step): the capture recipe, the buckets, and ``GraphCache`` (keyed replayed steps, their
memory pool, one failure policy, one description). ``StaticDecode`` adds what both decode graphs share: static
buffers grown by ``reserve``, a state left *resident* in them (the caller's state holds views of the buffers, so
the next step copies only its token), and the rule that the previous owner gets its own copies before another
state takes the buffers over.

The policy, everywhere: a step the graphs do not cover (too many rows, a block of several tokens, a state of
another kind) is answered with None and the caller runs its eager step; a capture that fails or memory that
runs out turns the graphs off for the rest of the run with one warning, and the run goes on eagerly, never
wrongly. ``capture=False`` runs the same static-buffer code eagerly: what the CPU tests compare with the plain
step (capture and replay need CUDA; ``harness.doctor`` compares them on a GPU). A decode's step may be compiled
(``harness.compiled_steps``) before it is captured; a compiled step that fails or parts from the eager one is
dropped, not the graphs."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Hashable

import torch

from harness.compiled_steps import CompiledStep, CompileRefused

log = logging.getLogger("harness")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a batch is padded up to one of these; a larger one runs eagerly
MIN_CAPACITY = 256
# From this many rows a decode step reads more keys and values than weights (Phi-1.5 at 2k positions: 400 MB a
# row against 2.8 GB of weights), so its graphs attend over tighter capacities (``attended_capacity``)
FINE_ROWS = 16


def row_bucket(rows: int) -> int | None:
    """The smallest row bucket that holds ``rows`` (None: more rows than any graph covers)."""
    return next((r for r in ROW_BUCKETS if r >= rows), None)


def capacity_bucket(positions: int) -> int:
    """KV capacity a graph covers for ``positions`` positions: 256, then five to eight eighths of the next power
    of two (320, 384, 448, 512, 640, ...): at most 1.25x the positions, while a run to 8k positions captures
    21 graphs per batch bucket."""
    if positions <= MIN_CAPACITY:
        return MIN_CAPACITY
    power = MIN_CAPACITY
    while power < positions:
        power *= 2
    return next(power * k // 8 for k in (5, 6, 7, 8) if power * k // 8 >= positions)


def attended_capacity(positions: int, rows: int) -> int:
    """Positions a graph of ``rows`` rows attends over, within buffers of ``capacity_bucket(positions)``: that
    bucket below ``FINE_ROWS`` rows (the weights dominate a step's reads), else the next multiple of a 32nd of the
    power of two above (64 at least): at most 1.125x the positions past 512 and 1.0625x past 1,024 instead of
    1.25x (Phi-1.5 at batch 64 and 2k positions: the bucket read 22% more bytes than the step needs), at 16
    graphs per doubling where the buckets take 4. The buffers still grow by buckets: a new capacity is a graph,
    not a copy."""
    bucket = capacity_bucket(positions)
    if rows < FINE_ROWS or positions <= MIN_CAPACITY:
        return bucket
    step = max(64, (1 << (positions - 1).bit_length()) // 32)
    return min(bucket, -(-positions // step) * step)


def on_side_stream(fn: Callable[[], Any], device) -> Any:
    """``fn()`` on a fresh side stream that waits for the current one, which then waits for it (PyTorch's
    recipe: lazy initialisation and autotuning before a capture are not recorded, and it starts settled)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        out = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


def new_pool(capture: bool = True):
    """A fresh memory pool for the graphs over a new set of static buffers (None with capture off). Never a
    dropped set's pool: when the last graph using a pool is destroyed PyTorch releases it, and capturing into its
    handle again fails in the caching allocator (``INTERNAL ASSERT FAILED ... use_count > 0``: a graphed backend
    used at batch 1 and then at batch 64 in one process, on an H200)."""
    return torch.cuda.graph_pool_handle() if capture else None


class CaptureFailed(RuntimeError):
    """A step could not be recorded into a graph (an op that syncs with the host, an unsupported kernel)."""


def capture(fn: Callable[[], Any], device, pool=None, warm: bool = True) -> torch.cuda.CUDAGraph:
    """A graph that replays ``fn`` (recorded, not run), after one warm-up run of it on a side stream (``warm``)."""
    if warm:
        on_side_stream(fn, device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise CaptureFailed(str(e).splitlines()[0][:160] if str(e) else type(e).__name__) from e
    return graph


class ReplayedStep:
    """A step over static buffers (``run``, which leaves its result in ``self.output``): recorded into a graph
    on CUDA, or run eagerly each time with capture off."""

    graph: torch.cuda.CUDAGraph | None = None
    output: Any = None

    def run(self) -> None:
        raise NotImplementedError

    def record(self, device, pool=None, warm: bool = True) -> None:
        self.graph = capture(self.run, device, pool, warm)

    def replay(self) -> Any:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        return self.output


class GraphCache:
    """Replayed steps by key (a batch bucket and a capacity, a batch shape), all in one memory pool, with the one
    failure policy (the module's docstring). ``what`` names the graphs in the warning and in ``describe``."""

    def __init__(self, what: str, capture: bool = True, max_graphs: int | None = None):
        self.what, self.capture, self.max_graphs = what, capture, max_graphs
        self.graphs: dict[Hashable, ReplayedStep] = {}
        self.disabled: str | None = None  # why the graphs went off; eager from then on
        self.pools = 0  # memory pools taken: one for every set of graphs over one set of buffers
        self.replays = 0
        self.pool = None
        self.reset()

    def reset(self) -> None:
        """Drop every graph and take a fresh pool (the static buffers they read are about to be replaced)."""
        self.graphs.clear()
        self.pools += 1
        self.pool = new_pool(self.capture)

    def covers(self, key: Hashable) -> bool:
        """Whether a step of ``key`` can be replayed (graphs on, and its graph kept or room for it)."""
        return not self.disabled and (key in self.graphs or self.max_graphs is None
                                      or len(self.graphs) < self.max_graphs)

    def replay(self, key: Hashable, build: Callable[[Any], ReplayedStep],
               load: Callable[[ReplayedStep], None] | None = None) -> Any:
        """The output of ``key``'s step, replayed; ``build(pool)`` makes (and captures) it on first use, and
        ``load(step)`` copies this call's inputs into its static buffers first."""
        step = self.graphs.get(key)
        if step is None:
            step = self.graphs[key] = build(self.pool)
        if load is not None:
            load(step)
        self.replays += 1
        return step.replay()

    def attempt(self, work: Callable[[], Any], on_give_up: Callable[[], None] = lambda: None) -> Any:
        """``work()``, or None where a capture failed or memory ran out in it: then the graphs are off for the
        rest of the run (``on_give_up`` frees what they held) and the caller runs its eager step."""
        try:
            return work()
        except torch.cuda.OutOfMemoryError:
            self.give_up("the static buffers do not fit in free GPU memory", on_give_up)
        except CaptureFailed as e:
            self.give_up(f"a step could not be captured ({e})", on_give_up)
        return None

    def give_up(self, why: str, on_give_up: Callable[[], None] = lambda: None) -> None:
        log.warning("%s from CUDA graphs are off for the rest of this run: %s; running eagerly", self.what, why)
        self.disabled = why
        self.graphs.clear()
        on_give_up()

    def describe(self) -> str:
        if self.disabled:
            return f"eager ({self.disabled})"
        if not self.capture:
            return "static buffers"
        return f"CUDA graphs ({len(self.graphs)} shapes)" if self.graphs else "CUDA graphs"


class StaticDecode:
    """A single-token decode step replayed from graphs over static buffers: callable as ``(state, ids [b, 1],
    attention_mask [b, past + 1]) -> logits [b, V]``, or None for a step it does not cover (the caller's eager
    step runs it). Each subclass keeps its buffers and its run: how a state is read, copied in, and left holding
    views of the buffers."""

    logits_dtype: torch.dtype | None = None  # the logits' dtype as returned (None: the model's)
    step_function: Callable  # the eager step: a function of the model and a graph's static views (subclasses)

    def __init__(self, model, capture: bool = True, compile: bool = False):
        self.model, self.capture = model, capture
        self.device = next(model.parameters()).device
        self.cache = GraphCache("decode steps", capture)
        self.compiled = CompiledStep(type(self).step_function, "decode step") if compile else None
        self.buffers = None
        self.copies_in = 0  # states copied into the buffers (a resident one is not): the tests count them
        self._owner = None  # weak reference to what holds views of the static buffers

    @property
    def disabled(self) -> str | None:
        return self.cache.disabled

    def describe(self) -> str:
        graphs = self.cache.describe()
        return graphs if self.compiled is None or self.cache.disabled else f"{graphs}, {self.compiled.describe()}"

    def __call__(self, state, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        b = ids.shape[0]
        rows = row_bucket(b)
        if rows is None or ids.shape[1] != 1 or not self.takes(state) or self.cache.disabled:
            return None
        past = self.past(state, attention_mask)
        capacity = attended_capacity(past + 1, rows) if self.has_capacity else 0

        def work():
            self.reserve(state, rows, capacity_bucket(past + 1) if self.has_capacity else 0)
            if not self.resident(state, b):
                self.release_owner()
                self.copies_in += 1
                self.copy_in(state, b, past)
            self.fill(state, ids, attention_mask, rows, capacity, past)
            out = self.cache.replay((rows, capacity), lambda pool: self._build(rows, capacity, pool))
            # a copy: the next replay overwrites the graph's logits
            return out[:b].to(self.logits_dtype or out.dtype, copy=True)

        logits = self.cache.attempt(work, on_give_up=self._drop_buffers)
        if logits is None:
            return None
        self.hold(state, b, past)  # the state becomes (or stays) views of the buffers: the next step copies none
        self._owner = weakref.ref(self.owned(state))
        return logits

    def _build(self, rows: int, capacity: int, pool) -> ReplayedStep:
        """The graph of (rows, capacity): of the compiled step while it is on and matches the eager step at this
        graph's first step (or captures), else of the eager step."""
        if self.compiled is not None and not self.compiled.disabled:
            try:
                return self.new_graph(rows, capacity, pool, self.compiled)
            except (CompileRefused, CaptureFailed) as e:
                self.compiled.give_up(str(e))
        return self.new_graph(rows, capacity, pool, None)

    def reserve(self, state, rows: int, capacity: int) -> None:
        """Static buffers at least ``rows`` x ``capacity`` that fit ``state``; growing them drops every graph
        (new addresses) and its pool."""
        buf = self.buffers
        if buf is not None and buf.rows >= rows and buf.capacity >= capacity and self.fits(state):
            return
        if buf is not None and self.fits(state):
            rows, capacity = max(rows, buf.rows), max(capacity, buf.capacity)
        self.release_owner()
        self.cache.reset()
        self.buffers = None  # freed before the larger set is allocated
        self.buffers = self.allocate(state, rows, capacity)

    def release_owner(self) -> None:
        """Give what holds views of the static buffers its own copies before they are reused."""
        owner = self._owner() if self._owner is not None else None
        self._owner = None
        if owner is not None and self.buffers is not None:
            self.detach(owner)

    def _drop_buffers(self) -> None:
        self.release_owner()
        self.buffers = None

    # -- what each decode keeps: its buffers and its run ------------------------------------------------
    has_capacity = True  # whether graphs are keyed by a KV capacity (a pure recurrent stack has none)

    def takes(self, state) -> bool:
        """Whether the graphs can run this kind of state at all."""
        return True

    def past(self, state, attention_mask: torch.Tensor) -> int:
        raise NotImplementedError

    def fits(self, state) -> bool:
        """Whether the current buffers have ``state``'s layer shapes."""
        return True

    def allocate(self, state, rows: int, capacity: int):
        raise NotImplementedError

    def resident(self, state, b: int) -> bool:
        raise NotImplementedError

    def copy_in(self, state, b: int, past: int) -> None:
        raise NotImplementedError

    def fill(self, state, ids, attention_mask, rows: int, capacity: int, past: int) -> None:
        raise NotImplementedError

    def new_graph(self, rows: int, capacity: int, pool, compiled: CompiledStep | None) -> ReplayedStep:
        """A graph of ``step_function`` (``compiled``'s where given: its ``first`` checks the warm-up step)."""
        raise NotImplementedError

    def hold(self, state, b: int, past: int) -> None:
        raise NotImplementedError

    def owned(self, state):
        """The object whose layers hold the views (tracked weakly)."""
        return state

    def detach(self, owner) -> None:
        raise NotImplementedError
