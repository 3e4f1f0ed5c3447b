"""Batched greedy decoding shared by every backend.

A backend supplies the step contract (``harness.backends.base.StepModel``: prefill a left-padded batch, feed one
token per row, drop rows); this module owns everything above it: stop strings, EOS, ``max_new_tokens``, the
context limit, and the tool loop. Tool results are fed back through the same steps as *forced* tokens, so a row that is searching and a row that is
still reasoning share each forward pass, and generation continues from the cache or recurrent
state instead of re-reading the prompt. Written by hand because ``transformers.generate`` cannot inject
per-row tokens mid-generation, and the Phi-Mamba backend needs the same loop over its own state.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from harness.backends.base import GenRequest, GenResult, StepModel


@dataclass
class Prefix:
    """A prompt prefix shared by every request, prefilled once; its state is copied into each batch."""

    ids: list[int]
    state: Any
    logits: torch.Tensor


def common_prefix(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Longest common prefix, one token short of the shortest sequence so every row keeps a suffix."""
    if not seqs:
        return []
    n = min(len(s) for s in seqs) - 1
    first = seqs[0]
    for s in seqs[1:]:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
    return list(first[:max(n, 0)])


class IncrementalDetokenizer:
    """Text of a growing token list, decoding only a few tokens per step (as vLLM and TGI do).

    A token's text can depend on its neighbours (SentencePiece's leading space, UTF-8 bytes split across
    byte-level tokens), so each step decodes a window starting a little before the new tokens and appends
    the difference, holding back text that ends in an incomplete character."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: no per-call Python overhead
        self._decode = (lambda ids: backend.decode(ids, skip_special_tokens=False)) if backend is not None else \
            (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self.text = ""
        self._prefix = self._read = 0

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def reset(self, ids: list[int]) -> str:
        """Restart from a token list that was edited (not only extended): one full decode."""
        self.text = self._decode(ids)
        self._read = len(ids)
        self._prefix = max(0, self._read - 6)
        prefix_text = self._decode(ids[self._prefix:self._read])
        if not self.text.endswith(prefix_text) or prefix_text.endswith("\ufffd"):
            self._prefix = self._read  # no clean window: continue from here with no look-back
        return self.text

    def update(self, ids: list[int], final: bool = False) -> str:
        prefix_text = self._decode(ids[self._prefix:self._read])
        new_text = self._decode(ids[self._prefix:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(ids)
        return self.text

    def flush(self, ids: list[int]) -> str:
        """The text once generation has ended: what ``update`` held back for an incomplete character is kept
        (no later token can complete it), so the text is a full decode's, as transformers' and lm-eval's."""
        return self.update(ids, final=True)


@dataclass
class _Row:
    req: GenRequest
    prompt_len: int
    detok: IncrementalDetokenizer
    ids: list[int] = field(default_factory=list)  # generated and inserted tokens
    fed: int = 0  # how many of ``ids`` the model has been fed
    scan_from: int = 0  # character offset from which stop strings and tool calls are searched
    call: tuple[str, int] | None = None  # (text, end of call_end) of a call completed by the last token
    calls: int = 0
    new_tokens: int = 0
    tool_tokens: int = 0
    tool_spans: list[tuple[int, int]] = field(default_factory=list)
    retokenized_spans: list[tuple[int, int]] = field(default_factory=list)
    done: GenResult | None = None


def _new_rows(tokenizer, requests: Sequence[GenRequest]) -> tuple[list[list[int]], list[_Row]]:
    """Each request's prompt ids and its row; a request with no budget at all is finished already."""
    prompt_ids = [list(r.prompt_ids) if r.prompt_ids is not None else tokenizer(r.prompt)["input_ids"]
                  for r in requests]
    rows = [_Row(r, len(p), IncrementalDetokenizer(tokenizer)) for r, p in zip(requests, prompt_ids)]
    for row in rows:
        if row.req.max_new_tokens <= 0:
            row.done = GenResult("", "length", row.prompt_len, 0)
    return prompt_ids, rows


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, device, side: str = "left"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as one [batch, longest] tensor and its 0/1 mask, padded on ``side``: prompts are padded
    on the left (every row's next token is at the end), a block fed after a saved state on the right."""
    width = max(len(s) for s in seqs)
    if all(len(s) == width for s in seqs):  # no padding (a decode step's one token a row): one tensor, no loop
        ids = torch.tensor(seqs, dtype=torch.long)
        return ids.to(device), torch.ones_like(ids).to(device)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            at = slice(width - len(s), width) if side == "left" else slice(0, len(s))
            ids[i, at] = torch.tensor(s, dtype=torch.long)
            mask[i, at] = 1
    return ids.to(device), mask.to(device)


def pad_token_id(tokenizer) -> int:
    """The id padding is written with: the tokenizer's pad token, else its end of text (always masked)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_batch(seqs, pad_id, device, "left")


def right_pad(blocks: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_batch(blocks, pad_id, device, "right")


def shared_middles(seqs: Sequence[Sequence[int]], shared: int, least: int) -> list[tuple[int, int]]:
    """Each row's (owner, end): runs of consecutive rows that all share at least ``least`` tokens after their first
    ``shared`` (a prefix tree's order puts prompts that share a middle next to each other), owned by the run's
    first row, ``end`` where the run's common prefix ends (``common_prefix``'s, one token short of the shortest);
    a row in no run is its own, ending at ``shared``."""
    pairs: list[tuple[int, int]] = []
    r = 0
    while r < len(seqs):
        end, n = shared, r + 1
        while n < len(seqs):
            common = len(common_prefix([seqs[r], seqs[n]]))
            if common < shared + least or (n > r + 1 and common < end):  # a later row must share all of it
                break
            end = common if n == r + 1 else end
            n += 1
        pairs += [(r, end)] * (n - r)
        r = n
    return pairs


def shared_front_mask(seqs: Sequence[Sequence[int]], shared: int, device) -> torch.Tensor:
    """The attention mask of rows merged with their first ``shared`` tokens (the same in every row) in front and
    unpadded, each row's rest left-padded after them (``MergesRows.merge``'s layout with ``shared``; with 0, the
    left-padded mask)."""
    rest = left_pad([s[shared:] for s in seqs], 0, device)[1]
    return torch.cat([rest.new_ones((len(seqs), shared)), rest], dim=1)


@dataclass
class Started:
    """A batch whose prompts are prefilled already (``harness.backends.planner`` chooses how): the logits at
    each row's last prompt token [B, V], the decoding state, and the attention mask over everything fed so far."""

    logits: torch.Tensor
    state: Any
    mask: torch.Tensor


@dataclass
class _Running:
    """The rows being decoded: their request indices, the logits that choose each one's next token, the
    decoding state and the attention mask over everything fed so far."""

    active: list[int]
    logits: torch.Tensor
    state: Any
    mask: torch.Tensor


@torch.inference_mode()
def greedy_generate(stepper: StepModel, tokenizer, requests: Sequence[GenRequest], *, device="cpu",
                    max_context: int | None = None, start: Started | None = None, stats: dict | None = None
                    ) -> list[GenResult]:
    """Greedy-decode a batch. Rows finish independently and leave the batch; results keep request order.
    ``start``: the batch already prefilled (else its prompts are prefilled here, left-padded).

    Each step feeds every active row a block: its chosen token, followed by a tool result when that token
    completed a call. Blocks are right-padded to the longest, so a whole result is absorbed in the same
    forward pass that feeds the other rows their next token; where the stepper would feed such a block a
    call per token anyway (``StepModel.feeds_token_by_token``: recurrent families), each row is fed one token
    a step instead, its queued tokens over the next steps, and the others write theirs in the same calls."""
    if not requests:
        return []
    pad_id = pad_token_id(tokenizer)
    prompt_ids, rows = _new_rows(tokenizer, requests)
    if start is None:
        ids, mask = left_pad(prompt_ids, pad_id, device)
        logits, state = stepper.prefill(ids, mask)
        if stats is not None:
            stats["prefill_tokens"] = stats.get("prefill_tokens", 0) + ids.numel()
    else:
        logits, state, mask = start.logits, start.state, start.mask
    run = _Running(list(range(len(rows))), logits, state, mask)
    while _step(stepper, tokenizer, rows, run, max_context, stats):
        pass
    return [r.done for r in rows]


# New rows join once a sixteenth of the slots is free: each join is a prefill call and a copy of the state. At the
# trainer's 256 slots over an n = 64 evaluation's 5,000 gold traces: 32,970 steps (a quarter: 35,525; every free
# slot at once: 32,300; static batches: 46,860).
REFILL_FRACTION = 16


@torch.inference_mode()
def continuous_generate(stepper: StepModel, tokenizer, requests: Sequence[GenRequest], order: Sequence[int],
                        slots: int, admit: Callable[[list[int]], Started], *, max_context: int | None = None,
                        stats: dict | None = None) -> Iterator[tuple[list[int], list[GenResult]]]:
    """Greedy-decode ``requests`` with at most ``slots`` rows at a time, taken in ``order``: as rows finish, the
    next requests are prefilled (``admit``: their ``Started``) and joined to the running batch
    (``JoinsBatches.join``), so the steps follow the mean row's length, not each batch's longest. Yields
    (request indices, results) as rows finish, a sixteenth of the slots at a time. Each row is decoded as
    ``greedy_generate`` decodes it: its prompt prefilled with others, then fed its blocks; for a family whose
    batches are exact (the planner checks) its output does not depend on which rows it ran beside."""
    pending = list(reversed(order))
    rows: dict[int, _Row] = {}
    run: _Running | None = None
    finished: list[int] = []
    refill = refill_at(slots)
    while pending or run is not None:
        take = [pending.pop() for _ in range(admitted(slots, len(run.active) if run else 0, len(pending)))]
        if take:
            rows.update(zip(take, _new_rows(tokenizer, [requests[i] for i in take])[1]))
            start = admit(take)
            if run is None:
                run = _Running(take, start.logits, start.state, start.mask)
            else:
                run.mask, cuts = join_masks([run.mask, start.mask])
                run.state = stepper.join([run.state, start.state], cuts)
                run.logits = torch.cat([run.logits, start.logits])
                run.active = run.active + take
                if stats is not None:
                    stats["joins"] = stats.get("joins", 0) + 1
        before = run.active
        if not _step(stepper, tokenizer, rows, run, max_context, stats):
            run = None
        left = set(run.active) if run is not None else set()
        finished += [b for b in before if b not in left]
        if finished and (len(finished) >= refill or run is None):  # written about as often as rows join
            yield finished, [rows.pop(b).done for b in finished]
            finished = []


def admitted(slots: int, running: int, pending: int) -> int:
    """How many waiting requests join a batch of ``running`` rows: none until a sixteenth of the slots is free (or
    every request left fits), then as many as fit."""
    free = slots - running
    return min(free, pending) if pending and free >= min(refill_at(slots), pending) else 0


def refill_at(slots: int) -> int:
    """Free slots that make a join worth its prefill call (and the finished rows written together)."""
    return max(1, slots // REFILL_FRACTION)


def scheduled_steps(passes: Sequence[int], slots: int, continuous: bool = True) -> int:
    """The decode steps ``continuous_generate`` (or, ``continuous=False``, static batches of ``slots``) takes for
    rows, in order, that each stay for ``passes`` passes of its loop (a pass chooses a row's token or feeds it one
    queued; the last one ends it): the admission rule replayed without a model, to project a run's length."""
    pending, running, steps = list(reversed(passes)), [], 0
    while pending or running:
        if continuous or not running:
            running += [pending.pop() for _ in range(admitted(slots, len(running), len(pending)))]
        gap = min(running)  # passes to the next row's end: nothing joins before it
        running = [r - gap for r in running if r > gap]
        steps += gap if running else gap - 1  # the pass that ends the last running row feeds nothing
    return steps


def join_masks(masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Running batches' attention masks as one: the leading columns masked in every row of a batch cut, then each
    left-padded to the widest (rows' real positions stay right-aligned, as in a left-padded prefill). Returns the
    mask and each batch's (width, cut, pad): what ``JoinsBatches.join`` does to its cached positions."""
    cuts = []
    for m in masks:
        seen = m.any(0)
        cuts.append(int(seen.int().argmax()) if bool(seen.any()) else m.shape[1])
    width = max(m.shape[1] - c for m, c in zip(masks, cuts))
    out = torch.cat([torch.nn.functional.pad(m[:, c:], (width - (m.shape[1] - c), 0)) for m, c in zip(masks, cuts)])
    return out, [(m.shape[1], c, width - (m.shape[1] - c)) for m, c in zip(masks, cuts)]


def _step(stepper: StepModel, tokenizer, rows, run: _Running, max_context: int | None, stats: dict | None) -> bool:
    """One decode step of the running rows: each chooses its token (unless a tool result is still being fed),
    completed calls run, finished rows leave, the rest are fed their blocks. False once no row is left."""
    pad_id = pad_token_id(tokenizer)
    choice = run.logits.argmax(dim=-1).tolist()
    blocks, keep = [], []
    for j, b in enumerate(run.active):
        row = rows[b]
        if row.done is None and row.fed == len(row.ids):  # else a tool result is still being fed: no choice
            row.ids.append(choice[j])
            row.new_tokens += 1
            _after_model_token(row, choice[j], tokenizer, tokenizer.eos_token_id)
    _run_tool_calls([rows[b] for b in run.active if rows[b].done is None and rows[b].call is not None], tokenizer)
    for j, b in enumerate(run.active):
        row = rows[b]
        if row.done is not None:
            continue
        if max_context is not None and row.prompt_len + len(row.ids) > max_context:
            row.done = _finish(row, "context")
            continue
        blocks.append(row.ids[row.fed:])
        keep.append(j)
    if not keep:
        run.active = []
        return False
    widths = [len(block) for block in blocks]
    if max(widths) > 1 and stepper.feeds_token_by_token(widths):
        blocks = [block[:1] for block in blocks]
    for j, block in zip(keep, blocks):
        rows[run.active[j]].fed += len(block)
    if len(keep) < len(run.active):
        keep_t = torch.tensor(keep, device=run.mask.device)
        run.state = stepper.select(run.state, keep_t)
        run.mask = run.mask.index_select(0, keep_t)
        run.active = [run.active[j] for j in keep]
    block_ids, block_mask = right_pad(blocks, pad_id, run.mask.device)
    run.mask = torch.cat([run.mask, block_mask], dim=1)
    run.logits = stepper.step(run.state, block_ids, run.mask)
    if stats is not None:
        stats["decode_steps"] = stats.get("decode_steps", 0) + 1
    return True


class ContinueRows(Protocol):
    def __call__(self, seqs: list[list[int]], max_tokens: list[int], stops: list[list[str]]) -> list[list[int]]:
        """Greedy-continue each token sequence until one of its stop strings appears in the text it writes
        (the completing token included), EOS, or ``max_tokens`` new tokens; return the new token ids."""


def chunked_generate(continue_rows: ContinueRows, tokenizer, requests: Sequence[GenRequest], *,
                     max_context: int | None = None) -> list[GenResult]:
    """``greedy_generate`` for engines that decode runs of tokens themselves (vLLM): the same per-row state
    machine (stop strings, EOS, limits, tool calls, re-tokenised call ends) decides after every token of a
    run, so both paths give the same results by construction. A run stops at the tool's closing tag; the
    next run resubmits prompt + everything so far (vLLM's prefix cache makes that a continuation)."""
    if not requests:
        return []
    eos_id = tokenizer.eos_token_id
    prompt_ids, rows = _new_rows(tokenizer, requests)
    active = [b for b, row in enumerate(rows) if row.done is None]
    while active:
        budgets, stops = [], []
        for b in active:
            row = rows[b]
            if max_context is not None and row.prompt_len + len(row.ids) >= max_context:
                row.done = _finish(row, "context")
        active = [b for b in active if rows[b].done is None]
        if not active:
            break
        for b in active:
            row = rows[b]
            room = row.req.max_new_tokens - row.new_tokens
            if max_context is not None:
                room = min(room, max_context - row.prompt_len - len(row.ids))
            tool = row.req.tool
            budgets.append(room)
            stops.append(list(row.req.stop) + ([tool.call_end] if tool is not None and row.calls < tool.max_calls
                                               else []))
        runs = continue_rows([prompt_ids[b] + rows[b].ids for b in active], budgets, stops)
        for b, run in zip(active, runs):
            row = rows[b]
            for tok in run:
                row.ids.append(tok)
                row.new_tokens += 1
                _after_model_token(row, tok, tokenizer, eos_id)
                if row.done is not None or row.call is not None:
                    break
            else:  # the run ended on no token the state machine acts on: EOS left out of the ids, or the context
                full = max_context is not None and row.prompt_len + len(row.ids) >= max_context
                if not full:
                    row.new_tokens += 1  # the EOS the engine chose and left out, counted as the stepped loop does
                row.done = _finish(row, "context" if full else "eos")
        _run_tool_calls([rows[b] for b in active if rows[b].done is None and rows[b].call is not None], tokenizer)
        active = [b for b in active if rows[b].done is None]  # a row a tool result overfilled ends at the top
    return [r.done for r in rows]


def last_real_index(block_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token in a right-padded block."""
    return block_mask.sum(dim=1) - 1


def logits_at_last_real(logits: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits of a right-padded block → [B, V] at each row's last real token."""
    last = last_real_index(block_mask)
    return logits[torch.arange(len(last), device=last.device), last]


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text[start:]``, or None."""
    hits = [(i, s) for s in stops if s for i in [text.find(s, start)] if i >= 0]
    return min(hits) if hits else None


def _after_model_token(row: _Row, tok: int, tokenizer, eos_id) -> None:
    """Decide whether a row stops, calls its tool, or goes on, after the model chose ``tok``."""
    if eos_id is not None and tok == eos_id:
        row.ids.pop()
        row.done = _finish(row, "eos")
        return
    text = row.detok.update(row.ids)
    hit = first_stop(text, row.req.stop, row.scan_from)
    tool = row.req.tool
    call_at = text.find(tool.call_end, row.scan_from) if tool is not None and row.calls < tool.max_calls else -1
    if hit and (call_at < 0 or hit[0] < call_at + len(tool.call_end)):
        row.done = _finish(row, "stop", text=text[:hit[0]])
        row.done.stop_string = hit[1]
        return
    if row.new_tokens >= row.req.max_new_tokens:  # before any tool call: a model that calls on every token
        row.done = _finish(row, "length")  # must still stop
        return
    if call_at >= 0:
        row.call = (text, call_at + len(tool.call_end))


_TOOL_POOL: ThreadPoolExecutor | None = None


def _run_tool_calls(rows: list[_Row], tokenizer) -> None:
    """Run the calls completed in this step side by side (a slow search costs the batch one timeout, not
    one per row), then queue each row's tokens to feed: its call text up to the closing tag, then the result."""
    global _TOOL_POOL
    if not rows:
        return
    args = [(r.req.tool, r.call[0][:r.call[1]], r.scan_from) for r in rows]
    waiting = [i for i, a in enumerate(args) if getattr(a[0], "waits", True)]
    results = [None] * len(rows)
    if len(waiting) > 1:
        if _TOOL_POOL is None:
            _TOOL_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="icr-tool")
        for i, result in zip(waiting, _TOOL_POOL.map(lambda i: args[i][0](args[i][1], args[i][2]), waiting)):
            results[i] = result
    for i, (tool, text, start) in enumerate(args):
        if results[i] is None:  # a call that waits on nothing (or the step's only one): here, in turn
            results[i] = tool(text, start)
    for row, result in zip(rows, results):
        _feed_tool_result(row, result, tokenizer)


def _feed_tool_result(row: _Row, result: str, tokenizer) -> None:
    """The token that completed the call has not been fed to the model yet. When it also carries text past
    the closing tag (GPT-2's BPE has ``><`` as one token, so ``</search><result>`` ends in it), feed the
    tokens of the text up to the tag end instead: the model then sees exactly ``...</search><result>...``."""
    text, end = row.call
    row.call = None
    row.calls += 1
    if len(text) > end:
        before = row.detok.decode(row.ids[:-1])
        if text.startswith(before) and len(before) < end:
            piece = tokenizer(text[len(before):end], add_special_tokens=False)["input_ids"]
            row.ids[-1:] = piece
            row.retokenized_spans.append((len(row.ids) - len(piece), len(row.ids)))
        row.detok.reset(row.ids)
    result_ids = tokenizer(result, add_special_tokens=False)["input_ids"]
    row.tool_spans.append((len(row.ids), len(row.ids) + len(result_ids)))
    row.ids += result_ids
    row.tool_tokens += len(result_ids)
    # Search for the next call / stop only in what the model writes after the inserted result.
    row.scan_from = len(row.detok.update(row.ids))


def _finish(row: _Row, reason: str, text: str | None = None) -> GenResult:
    if text is None:
        text = row.detok.flush(row.ids)
    return GenResult(text=text, finish_reason=reason, prompt_tokens=row.prompt_len, new_tokens=row.new_tokens,
                     tool_tokens=row.tool_tokens, token_ids=list(row.ids), tool_spans=list(row.tool_spans),
                     retokenized_spans=list(row.retokenized_spans))
