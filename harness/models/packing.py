"""Packed rows: a batch's samples laid end to end in as few rows as hold them, so a step computes no padding.

A right-padded IsTree retrieval batch at n=64 pads every sample to the batch's longest (2,535 tokens where
samples average ~1,731); packed, the same samples fill about 1/1.46 of the rows. The models see each sample as
they would alone: the Mamba scan and causal convolution restart their states at each sample's first token
(``starts``, read by the mixers through ``packed_rows``), each sample attends causally to itself alone
(``masks.per_sample_attention``, from the samples' spans), and positions restart per sample. The loss is the
padded batch's: the same targets under the same mask, averaged over the same count (a sample's first token is
never a target, so no target crosses from one sample into the next; ``pack`` checks it).

Rows are filled first-fit in decreasing length (a sample never splits), to the batch's longest sample, or
(``one_row``, on a CPU) all samples go end to end into one row that computes no padding at all. A row's width
costs nothing there: the scan and the convolution cost their tokens, and attention runs on each sample alone
whatever row holds it. At n=32 retrieval, batch 8, rows of the batch's width hold 78% of the padded tokens
and one row 70%. On a GPU rows keep the batch's width: the Triton scan walks a row's chunks in turn, so fewer,
longer rows would leave its SMs idle."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

_STARTS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("packed_starts", default=None)
_SPANS: contextvars.ContextVar[list | None] = contextvars.ContextVar("packed_spans", default=None)


@dataclass
class Packed:
    """A packed batch: ``ids``/``mask`` [rows, T] as the padded batch's (the tail of a row is padding, mask 0),
    ``starts`` [rows, T] (1.0 at each sample's first token), ``positions`` [rows, T] (restarting per sample;
    counting on through a row's padding), and ``where`` [(row, offset, length)] per sample of the padded batch."""

    ids: torch.Tensor
    mask: torch.Tensor
    starts: torch.Tensor
    positions: torch.Tensor
    where: list[tuple[int, int, int]]

    def to(self, device, non_blocking: bool = False) -> "Packed":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Packed(move(self.ids), move(self.mask), move(self.starts), move(self.positions), self.where)


def sample_lengths(ids: torch.Tensor, pad_id: int) -> list[int]:
    """Each right-padded row's length: up to and including its last token that is not ``pad_id``."""
    real = ids != pad_id
    last = real.shape[1] - real.flip(1).int().argmax(1)  # past the last real token
    last = torch.where(real.any(1), last, torch.zeros_like(last))
    return [int(n) for n in last]


def _first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Sample indices per row: first-fit in decreasing length into rows of ``width``."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def _layout(lengths: list[int], length: int, one_row: bool) -> tuple[int, list[list[int]]]:
    """(row width, sample indices per row): rows of the batch's ``length``, or (``one_row``) one row of them all."""
    if one_row:
        return max(1, sum(lengths)), [list(range(len(lengths)))]
    return length, _first_fit(lengths, length)


def pack(ids: torch.Tensor, mask: torch.Tensor, pad_id: int, one_row: bool = False) -> Packed:
    """The padded batch (``ids``, its loss ``mask``) as packed rows (``_layout``: first-fit decreasing)."""
    lengths = sample_lengths(ids, pad_id)
    width, rows = _layout(lengths, ids.shape[1], one_row)
    out_ids = torch.full((len(rows), width), pad_id, dtype=ids.dtype)
    out_mask = torch.zeros((len(rows), width), dtype=mask.dtype)
    starts = torch.zeros((len(rows), width), dtype=torch.float32)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    where = [(0, 0, 0)] * len(lengths)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            if n and mask[i, 0] != 0:
                raise ValueError(f"sample {i}'s first token is a loss target: packed, it would be predicted from "
                                 "the sample before it")
            out_ids[r, at:at + n] = ids[i, :n]
            out_mask[r, at:at + n] = mask[i, :n]
            starts[r, at] = 1.0 if n else 0.0
            positions[r, at:at + n] = torch.arange(n)
            where[i] = (r, at, n)
            at += n
        last = members[-1]
        positions[r, at:] = torch.arange(lengths[last], lengths[last] + width - at)  # padding: the last sample's
    return Packed(out_ids, out_mask, starts, positions, where)


def packed_tokens(ids: torch.Tensor, pad_id: int, one_row: bool = False) -> tuple[int, int]:
    """(tokens a packed step computes, tokens the padded step computes) for this padded batch."""
    width, rows = _layout(sample_lengths(ids, pad_id), ids.shape[1], one_row)
    return len(rows) * width, ids.numel()


def one_row_on(device_type: str) -> bool:
    """Whether ``pack`` lays a batch out as one row on this device (the module's docstring says why)."""
    return device_type == "cpu"


@contextlib.contextmanager
def packed_rows(starts: torch.Tensor | None, spans: list[tuple[int, int, int]] | None = None):
    """Within it, the models' Mamba mixers restart their states where ``starts`` is 1 (None: not packed), and
    ``spans`` (``Packed.where``: each sample's row, offset and length, on the host) lets attention run causally
    on each sample alone (``masks.register_causal_sdpa``) instead of under a dense block mask."""
    token, spans_token = _STARTS.set(starts), _SPANS.set(spans)
    try:
        yield
    finally:
        _STARTS.reset(token)
        _SPANS.reset(spans_token)


def current_starts() -> torch.Tensor | None:
    """The packed rows' ``starts`` a forward pass runs under (``packed_rows``), or None. None while dynamo
    traces (a compiled decode step is never packed rows, and dynamo cannot trace a context variable)."""
    return None if torch.compiler.is_compiling() else _STARTS.get()


def current_spans() -> list[tuple[int, int, int]] | None:
    """The packed rows' sample spans a forward pass runs under (``packed_rows``), or None (and while dynamo
    traces, as ``current_starts``)."""
    return None if torch.compiler.is_compiling() else _SPANS.get()
