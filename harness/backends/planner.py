"""How a run's prompts are prefilled and batched: the one place that decides it.

Three plans, the same outputs (``tests/test_prefix_tree.py``, ``tests/test_families.py``):

    none   every prompt prefilled whole, in left-padded batches, longest first
    batch  the prefix every prompt shares prefilled once and copied into each batch; each row's rest fed as one
           right-padded block
    tree   a prefix tree over all prompts (``harness.backends.prefix_tree``), the state kept at its branch points;
           below its snapshot a prompt is prefilled either alone and unpadded ("rows": the fewest tokens, one
           call per prompt) or with the rest of its batch as one right-padded block ("block": one call a batch)

Decoding then runs batch by batch or, where the backend joins batches (``batching``), with new rows taking the
slots of finished ones (continuous batching, ``generation.continuous_generate``).

``auto`` takes the plan a cost model of this device and model predicts fastest. The model is measured, not
guessed: three prefills of the backend (a short one for what a call costs whatever its size, one row and a
small batch of the run's typical length for what a token costs alone and batched) price every possible plan's
calls and tokens; decoding is the same work in every plan and left out. The rates are measured once a machine,
model shape and set of kernels, and kept in the cache folder (``cost-models.json``, as the CPU's linear kernel
is): a later run reads them (0.12-0.6 s of prefills saved a run on a 2-core CPU), and every run on the machine
then picks the same plan for the same prompts. Rates measured while other processes kept the cores busy serve
their own run only (``MachineChoices.recall``'s ``quiet_only``). On a CPU one unpadded row is the
cheapest way to compute a token (padded attention is not), so the tree's rows win; on a GPU a batch is, so the
tree's blocks or ``batch`` win. What is possible at all comes from the backend (``batches_exact``,
``prefix_exact``, ``tree_unsupported``); a plan asked for that is not possible falls back, and says why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from harness.backends.base import (
    GenRequest,
    GenResult,
    Generation,
    PlanRecord,
    StepModel,
    count,
    counters,
    join_refusal,
    probe_ids,
)
from harness.backends.generation import (
    Prefix,
    Started,
    common_prefix,
    continuous_generate,
    greedy_generate,
    left_pad,
    pad_token_id,
    right_pad,
    shared_front_mask,
)
from harness.backends.prefix_tree import (
    PrefixStates,
    PrefixTree,
    default_budget,
    parse_bytes,
)
from harness.cache import MachineChoices, machine_key

log = logging.getLogger("harness")

BATCHING = ("auto", "static", "continuous")  # auto: continuous where the backend joins batches and it pays
MOSTLY_ATTENTION = 0.5  # on a CPU, auto keeps static batches above this share of attention layers (``batching``)
PREFIX_REUSE = ("auto", "tree", "tree-rows", "tree-block", "batch", "none")  # tree-*: the tree's prefill forced
MIN_SHARED_PREFIX = 16  # below this, copying a prefix state costs more than recomputing it
CALIBRATION_TOKENS = 1024  # the longest prompt length the cost model is measured at
TIMINGS = 3  # timed prefills a point of the cost model on a CPU, the fastest counting (a CPU's cores are shared)
CUDA_TIMINGS = 1  # on a GPU one, as before: the quick suite times auto with its measuring (``forget_costs``)


@dataclass(frozen=True)
class Costs:
    """Seconds a prefill call takes: a fixed part, plus a part per token (pads included) and a part per pair of a
    token and a key it attends to, each for one unpadded row and for a padded batch. The pairs are what grows with
    a prompt's context, where a padded batch's rows attend over their pads and the tree's rows over none: priced
    by tokens alone, plans that run far apart were priced close together."""

    call: float
    row_token: float
    batch_token: float
    length: int
    rows: int
    row_pair: float = 0.0
    batch_pair: float = 0.0

    def prefill(self, rows: int, width: int, past: float = 0) -> float:
        """A call of ``rows`` rows of ``width`` tokens each after ``past`` cached ones."""
        token, pair = (self.row_token, self.row_pair) if rows == 1 else (self.batch_token, self.batch_pair)
        return self.call + rows * width * (token + pair * (past + (width + 1) / 2))

    def rates(self) -> dict:
        """The seconds as ``cost-models.json`` keeps them."""
        return {"call": self.call, "row_token": self.row_token, "batch_token": self.batch_token,
                "row_pair": self.row_pair, "batch_pair": self.batch_pair}

    def describe(self) -> dict:
        return {"call_ms": round(self.call * 1e3, 3), "token_us_alone": round(self.row_token * 1e6, 3),
                "token_us_batched": round(self.batch_token * 1e6, 3), "pair_ns_alone": round(self.row_pair * 1e9, 4),
                "pair_ns_batched": round(self.batch_pair * 1e9, 4), "measured_at": [self.rows, self.length]}


# The cost models read or measured so far, per backend (its entry goes with it), then length and rows.
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
REMEMBERED = MachineChoices("cost-models.json", "the planner's cost model")


def forget_costs(backend: StepModel, remembered: bool = False) -> None:
    """Read ``backend``'s cost model again at its next ``auto`` plan, as a fresh process on this machine would (a
    benchmark times ``auto`` as a run pays it); ``remembered``: measure it again too, as a machine's first run
    does."""
    _COSTS.pop(backend, None)
    shape = _shape_key(backend) if remembered else None
    if shape is not None:
        REMEMBERED.forget(lambda key: key.startswith(shape))


def measure_costs(backend: StepModel, length: int, rows: int) -> Costs:
    """The cost model's rates at ``length`` tokens and ``rows`` rows: this process's, else what this machine
    measured for a model of this shape, kernels and dtype (the cache folder), else measured now (``time_costs``)
    and remembered in both."""
    cache = _COSTS.setdefault(backend, {})
    if (length, rows) not in cache:
        shape = _shape_key(backend)
        if shape is None:  # no configuration to know the model by: measured once a process
            cache[(length, rows)] = time_costs(backend, length, rows)
        else:
            rates = REMEMBERED.recall(f"{shape} | {rows} x {length}",  # every plan gives the same outputs
                                      lambda: time_costs(backend, length, rows).rates(), _usable, quiet_only=True)
            cache[(length, rows)] = Costs(rates["call"], rates["row_token"], rates["batch_token"], length, rows,
                                          rates["row_pair"], rates["batch_pair"])
    return cache[(length, rows)]


@torch.inference_mode()
def time_costs(backend: StepModel, length: int, rows: int) -> Costs:
    """The cost model measured now: prefills of throwaway tokens (nothing is counted as the run's work), one row
    and ``rows`` rows at ``length`` tokens and at a quarter of it (the difference prices a token's context), each
    on a CPU the fastest of ``TIMINGS`` (another process on the cores only ever adds time)."""
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda *_: None)
    timings = CUDA_TIMINGS if backend.device.type == "cuda" else TIMINGS

    def timed(r: int, n: int) -> float:
        ids = probe_ids(backend, r, n)
        mask = torch.ones_like(ids)
        if r > 1:
            mask[0, 0] = 0  # one pad, so the batch takes the masked path a real padded batch takes
        best = float("inf")
        for _ in range(timings):
            sync(backend.device)
            t = time.perf_counter()
            backend.prefill(ids, mask)
            sync(backend.device)
            best = min(best, time.perf_counter() - t)
        return best

    timed(1, 16)  # first-call costs (lazy initialisation, kernel selection) out of the measurement
    call, short = timed(1, 16), max(length // 4, 1)
    row = _per_token_and_pair(short, length, timed(1, short) - call, timed(1, length) - call)
    batch = _per_token_and_pair(short, length, (timed(rows, short) - call) / rows,
                                (timed(rows, length) - call) / rows)
    return Costs(call, row[0], batch[0], length, rows, row[1], batch[1])


def _per_token_and_pair(short: int, long: int, t_short: float, t_long: float) -> tuple[float, float]:
    """(seconds a token, seconds a token-key pair) of a row's prefill that took ``t_short`` for ``short`` tokens
    and ``t_long`` for ``long``: t(n) = n * token + n (n + 1) / 2 * pair, solved for the two; neither negative."""
    p_short, p_long = short * (short + 1) / 2, long * (long + 1) / 2
    det = long * p_short - short * p_long
    pair = (t_short * long - t_long * short) / det if det else 0.0
    if pair <= 0 or short == long:
        return max(t_long, 0.0) / long, 0.0
    token = (t_long - p_long * pair) / long
    if token < 0:
        return 0.0, max(t_long, 0.0) / p_long
    return token, pair


def _shape_key(backend: StepModel) -> str | None:
    """What a remembered cost model holds for: the machine (its processor or GPU, torch, threads), the backend as
    it describes itself (kernels, dtype, decode path) and its model's configuration without its path; None for a
    model with no configuration to read."""
    config = getattr(getattr(backend, "model", None), "config", None)
    if config is None:
        return None
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    shape = {k: v for k, v in fields.items() if not k.startswith("_") and k != "transformers_version"}
    device = backend.device
    where = (f"{torch.cuda.get_device_name(device)} | torch {torch.__version__}" if device.type == "cuda"
             else machine_key())
    what = json.dumps({"backend": backend.describe().to_json(), "config": shape}, sort_keys=True, default=str)
    return f"{where} | {type(backend).__name__} {hashlib.sha256(what.encode()).hexdigest()[:16]}"


def _usable(rates) -> bool:
    """A remembered model with every rate (one from before the pair rates is measured again)."""
    return isinstance(rates, dict) and all(isinstance(rates.get(k), (int, float)) and rates[k] >= 0
                                           for k in ("call", "row_token", "batch_token", "row_pair", "batch_pair"))


def plan_batches(lengths: Sequence[int], batch_size: int | str, token_budget: int, max_new: int,
                 order: Sequence[int] | None = None) -> list[list[int]]:
    """Consecutive runs of ``order`` (default: longest first, so an out-of-memory shows at once; the prefix tree
    gives its depth-first order); ``auto`` fills each batch up to a token budget."""
    order = list(order) if order is not None else sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if batch_size != "auto":
        bs = int(batch_size)
        return [order[i:i + bs] for i in range(0, len(order), bs)]
    batches, cur, longest = [], [], 0
    for i in order:
        width = max(longest, lengths[i]) + max_new
        if cur and (len(cur) + 1) * width > token_budget:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Plan:
    mode: str  # tree | batch | none
    asked: str
    batches: list[list[int]]
    reason: str = ""
    tree_prefill: str | None = None  # rows | block (tree only)
    shared: list[int] = field(default_factory=list)  # batch: the prefix every prompt shares
    tree: PrefixTree | None = None
    estimates: dict[str, float] = field(default_factory=dict)  # predicted prefill seconds of each candidate
    costs: Costs | None = None

    @property
    def name(self) -> str:
        return f"tree-{self.tree_prefill}" if self.mode == "tree" else self.mode

    def record(self) -> PlanRecord:
        return PlanRecord(ran=self.name, asked=self.asked, reason=self.reason, estimates_s=self.estimates or None,
                          costs=self.costs.describe() if self.costs is not None else None)


def _tree_shape(tree: PrefixTree) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """What the tree's plans compute, budget permitting: each branch point's run of tokens (tokens, tokens before
    it), and each prompt's tokens below its deepest branch point above its end (tokens, that point's depth)."""
    branch = [(len(n.ids), n.depth - len(n.ids)) for n in tree.nodes() if n is not tree.root and n.pending >= 2]
    below = []
    for i, s in enumerate(tree.seqs):
        depth = max((n.depth for n in tree.path(i) if n.pending >= 2 and n.depth < len(s)), default=0)
        below.append((len(s) - depth, depth))
    return branch, below


def _estimate(name: str, costs: Costs, lengths: list[int], batches: list[list[int]], shared: int,
              shape: tuple[list[tuple[int, int]], list[tuple[int, int]]] | None) -> float:
    if name == "none":
        return sum(costs.prefill(len(b), max(lengths[i] for i in b)) for b in batches)
    if name == "batch":
        return costs.prefill(1, shared) + sum(costs.prefill(len(b), max(lengths[i] for i in b) - shared, shared)
                                              for b in batches)
    branch, below = shape
    snapshots = sum(costs.prefill(1, tokens, past) for tokens, past in branch)
    if name == "tree-rows":
        return snapshots + sum(costs.prefill(1, *below[i]) for b in batches for i in b)
    return snapshots + sum(costs.prefill(len(b), max(below[i][0] for i in b), sum(below[i][1] for i in b) / len(b))
                           for b in batches)


def make_plan(backend: StepModel, ids: list[list[int]], max_new: int, batch_size: int | str = "auto",
              asked: str = "auto", costs: Costs | None = None) -> Plan:
    """The plan for these prompts: ``asked`` where it is possible (else the next one down, tree → batch → none,
    with the reason), the cheapest by the cost model where several are (``auto``, and the tree's two prefills)."""
    if asked not in PREFIX_REUSE:
        raise ValueError(f"prefix reuse {asked!r}: use one of {', '.join(PREFIX_REUSE)}")
    n, lengths = len(ids), [len(x) for x in ids]
    notes = []
    if not backend.batches_exact():
        batch_size = 1
        notes.append(f"the {backend.describe().family or backend.name} family cannot keep padding out of its "
                     "state: each sample runs alone and unpadded (exact; the batch size only groups the progress)")
    budget = backend.token_budget() if batch_size == "auto" else 0
    why_not: dict[str, str] = {}
    shared = common_prefix(ids) if n > 1 else []
    if not backend.prefix_exact():
        why_not["batch"] = "a block fed after a copied state is not exact for this model"
    elif len(shared) < MIN_SHARED_PREFIX:
        why_not["batch"] = f"the prompts share {len(shared)} leading tokens (reuse pays from {MIN_SHARED_PREFIX})"
    tree_why = backend.tree_unsupported() or (None if n > 1 else "a single prompt has nothing to share")
    if tree_why:
        why_not["tree"] = tree_why
    tree = PrefixTree(ids) if "tree" not in why_not else None
    longest_first = plan_batches(lengths, batch_size, budget, max_new)
    tree_batches = plan_batches(lengths, batch_size, budget, max_new, order=tree.order()) if tree else []
    candidates = {"tree-rows": tree_batches, "tree-block": tree_batches, "batch": longest_first,
                  "none": longest_first}
    if "tree" in why_not:
        del candidates["tree-rows"], candidates["tree-block"]
    elif not backend.prefix_exact() or max(map(len, tree_batches)) < 2:
        del candidates["tree-block"]
    if "batch" in why_not:
        del candidates["batch"]
    if asked != "auto":
        chain = ("tree", "batch", "none")
        mode = asked.split("-")[0]
        for fallback in chain[chain.index(mode):]:
            if fallback == "none" or fallback not in why_not:
                break
            notes.append(f"{fallback} is not possible here: {why_not[fallback]}")
        if fallback == "tree" and asked != "tree":  # the tree's prefill forced
            if asked not in candidates:
                notes.append("the tree's block prefill is not possible here (a block after a copied state is not "
                             "exact, or every batch holds one prompt): rows")
            candidates = {k: v for k, v in candidates.items() if k == asked} or {"tree-rows": tree_batches}
        else:
            candidates = {k: v for k, v in candidates.items() if k.split("-")[0] == fallback}
    estimates: dict[str, float] = {}
    if len(candidates) > 1:
        if costs is None:
            typical = sorted(lengths)[n // 2]
            rows = min(max(map(len, next(iter(candidates.values())))), 4 if backend.device.type == "cuda" else 2)
            costs = measure_costs(backend, min(typical, CALIBRATION_TOKENS), max(2, rows))
        shape = _tree_shape(tree) if tree is not None else None  # once for both tree prefills
        estimates = {k: _estimate(k, costs, lengths, b, len(shared), shape) for k, b in candidates.items()}
        name = min(estimates, key=estimates.get)
        notes.append("fastest by the measured cost model: " + ", ".join(
            f"{k} {v:.3g} s" for k, v in sorted(estimates.items(), key=lambda kv: kv[1])))
    else:
        name = next(iter(candidates))
        costs = None
    mode = name.split("-")[0]
    return Plan(mode=mode, asked=asked, batches=candidates[name], reason="; ".join(notes),
                tree_prefill=name.split("-")[1] if mode == "tree" else None,
                shared=list(shared) if mode == "batch" else [], tree=tree, estimates=estimates, costs=costs)


def batching(backend: StepModel, plan: Plan, asked: str = "auto") -> tuple[str, str]:
    """(continuous | static, why). Continuous where there is more than one batch and the backend joins batches
    (``JoinsBatches``): the slots are the plan's first batch (its longest prompts: the tightest in memory), and
    new rows take finished ones' slots; the outputs are the static batches' (exact families, tested). ``auto``
    stays static on a CPU for a model whose layers mostly attend: a join pads every row's keys to the oldest
    running row's span, and a CPU's attention costs what it computes (IsTree n = 32 evaluations at batch 16,
    ``benchmarks/live_eval.py``: with 1.33x fewer steps the 0.5M Transformer took 1.37x longer, the hybrid with
    one attention layer of 15 0.86x as long, Mamba 0.83x); a recurrent state is fixed-size, and a GPU's
    small-model decode step is bound by its launches, not its keys."""
    if asked not in BATCHING:
        raise ValueError(f"batching {asked!r}: use one of {', '.join(BATCHING)}")
    if asked == "static":
        return "static", "asked for"
    if len(plan.batches) < 2:
        return "static", "one batch"
    if not backend.batches_exact():
        return "static", "each sample runs alone"
    why = join_refusal(backend)
    if why:
        return "static", why
    if asked == "auto" and backend.device.type == "cpu" and backend.key_share() > MOSTLY_ATTENTION:
        return "static", ("on a CPU, a model whose layers mostly attend would attend over joined batches' padded "
                          "keys (continuous: asked for only)")
    return "continuous", f"{len(plan.batches[0])} slots, refilled as rows finish"


def generate_all(backend: StepModel, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                 prefix_reuse: str = "auto", prefix_memory: str | int = "auto", batching_asked: str = "auto"
                 ) -> Generation:
    """Plan, then generate (``Backend.generate_all``'s contract): batch by batch, or with rows refilled as they
    finish where ``batching`` says so (``batching_asked``: auto | static | continuous)."""
    tok = backend.tokenizer
    requests = [r if r.prompt_ids is not None else dataclasses.replace(r, prompt_ids=tok(r.prompt)["input_ids"])
                for r in requests]
    ids = [list(r.prompt_ids) for r in requests]
    if not requests:
        return Generation(PlanRecord(ran="none", asked=prefix_reuse), iter(()))
    plan = make_plan(backend, ids, max(r.max_new_tokens for r in requests), batch_size, prefix_reuse)
    sizes = [len(b) for b in plan.batches]
    log.info("prefill plan: %s for %d prompts in %d batches of %d-%d%s", plan.name, len(ids), len(sizes), min(sizes),
             max(sizes), f" ({plan.reason})" if plan.reason else "")
    record = plan.record()
    record.batching, record.batching_reason = batching(backend, plan, batching_asked)
    if record.batching == "continuous":
        log.info("continuous batching: %s", record.batching_reason)
    record.prompt_tokens, record.tree_tokens = sum(map(len, ids)), (plan.tree or PrefixTree(ids)).tree_tokens
    if plan.mode == "tree":
        budget = default_budget(backend.device) if prefix_memory == "auto" else (
            prefix_memory if isinstance(prefix_memory, int) else parse_bytes(prefix_memory))
        record.prefix_memory_bytes = budget
        log.info("prefix tree: %d prompt tokens, %d distinct (snapshots within %.2f GiB)", record.prompt_tokens,
                 record.tree_tokens, budget / 2 ** 30)
    return Generation(record, _run(backend, requests, plan, record))


def _run(backend: StepModel, requests: list[GenRequest], plan: Plan, record: PlanRecord
         ) -> Iterator[tuple[list[int], list[GenResult]]]:
    stats = counters(backend)
    before = stats.get("prefill_tokens", 0)
    states = PrefixStates(backend, plan.tree, record.prefix_memory_bytes) if plan.mode == "tree" else None
    prefix = _prefill_prefix(backend, plan.shared) if plan.mode == "batch" else None
    try:
        if record.batching == "continuous":
            def admit(batch: list[int]) -> Started:
                return _prefill(backend, [requests[i] for i in batch], batch, plan, states, prefix)

            yield from continuous_generate(backend, backend.tokenizer, requests,
                                           [i for b in plan.batches for i in b], len(plan.batches[0]), admit,
                                           max_context=backend.max_context, stats=stats)
            return
        for batch in plan.batches:
            reqs = [requests[i] for i in batch]
            start = _prefill(backend, reqs, batch, plan, states, prefix)
            yield batch, greedy_generate(backend, backend.tokenizer, reqs, device=backend.device,
                                         max_context=backend.max_context, start=start, stats=stats)
    finally:
        record.prefill_tokens = stats.get("prefill_tokens", 0) - before
        if states is not None:
            record.snapshots = {"prefix_snapshot_peak_bytes": states.peak, "prefix_snapshot_left_bytes": states.used,
                                "prefix_snapshots_recomputed": states.skipped}


@torch.inference_mode()
def _prefill_prefix(backend: StepModel, ids: list[int]) -> Prefix:
    t = torch.tensor([ids], device=backend.device)
    logits, state = backend.prefill(t, torch.ones_like(t))
    count(backend, "prefill_tokens", len(ids))
    count(backend, "prefix_tokens", len(ids))
    return Prefix(ids, state, logits)


@torch.inference_mode()
def _prefill(backend: StepModel, reqs: list[GenRequest], batch: list[int], plan: Plan,
             states: PrefixStates | None, prefix: Prefix | None) -> Started:
    """One batch's prompts prefilled the way the plan says."""
    pad = pad_token_id(backend.tokenizer)
    ids = [list(r.prompt_ids) for r in reqs]
    device = backend.device
    if states is not None:
        block = states.start_block(batch) if plan.tree_prefill == "block" else None
        if block is None:  # each prompt alone below its snapshot (counted as it ran), the rows merged
            # the prompts' common front kept in front (read once a step where the backend can), pads after it, or
            # where the backend has room for the batch, each row prefilled into its place there, pads after it
            shared = len(common_prefix(ids)) if len(ids) > 1 and backend.merges_shared_front() else 0
            slots = backend.row_slots(len(ids), max(map(len, ids))) if shared else None
            rows = [states.start(i, slots, r) for r, i in enumerate(batch)]
            if slots is not None:
                state = backend.merge_slots([r.state for r in rows], [r.ids for r in rows], shared, slots)
                mask = right_pad(ids, pad, device)[1]
            else:
                state = backend.merge([r.state for r in rows], [len(r.ids) for r in rows], shared)
                mask = shared_front_mask(ids, shared, device)  # shared 0: left-padded
            logits = torch.cat([r.logits for r in rows])
            for r in rows:  # a started row is used once: the batch state replaces it
                r.state = None
            return Started(logits, state, mask)
        bases, below = block
        state = backend.merge([b.state for b in bases], [len(b.ids) for b in bases])
        past = left_pad([b.ids for b in bases], pad, device)[1]
        block_ids, block_mask = right_pad(below, pad, device)
        mask = torch.cat([past, block_mask], dim=1)
        count(backend, "prefill_tokens", block_ids.numel())
        return Started(backend.step(state, block_ids, mask), state, mask)
    if prefix is not None:  # copy the prefix state into every row, then each row's rest as one block
        n = len(prefix.ids)
        state = backend.expand(prefix.state, len(reqs))
        block_ids, block_mask = right_pad([p[n:] for p in ids], pad, device)
        mask = torch.cat([block_mask.new_ones((len(reqs), n)), block_mask], dim=1)
        count(backend, "prefill_tokens", block_ids.numel())
        return Started(backend.step(state, block_ids, mask), state, mask)
    block_ids, mask = left_pad(ids, pad, device)
    logits, state = backend.prefill(block_ids, mask)
    count(backend, "prefill_tokens", block_ids.numel())
    return Started(logits, state, mask)
