"""Every shared prompt prefix of a run computed once: a radix tree over the token ids of all pending prompts,
with the model state snapshotted at its branch points.

A position sweep's prompts share far more than the few-shot exemplars: with the gold paragraph at slot p, the
distractors before it are the same text as in every prompt whose gold comes later; a needle's phone book is
the same up to the question. ``PrefixStates`` hands out each prompt's prefilled state in an order that walks
the tree depth first: the state at a branch point (KV rows for attention layers, conv and SSM state for
recurrent ones, both for hybrids) is kept while prompts below it are pending and freed when the last of them
has started; each prompt then computes only the tokens below its deepest kept snapshot. A snapshot that does
not fit the memory budget is not kept: the prompts below it recompute those tokens (never an out-of-memory).

Written here because no library does this for recurrent state: vLLM's prefix caching shares attention KV in
fixed blocks (for Mamba hybrids block-aligned or off), lm-eval shares nothing, and transformers' caches have no
notion of a tree. A recurrent snapshot costs O(1) memory, whatever its depth.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from harness.backends.base import count, state_nbytes
from harness.backends.generation import Prefix


@dataclass(eq=False)
class Node:
    """A run of tokens every prompt below shares; ``depth`` counts the tokens from the root to its end."""

    ids: list[int]
    depth: int
    parent: "Node | None"
    children: dict[int, "Node"] = field(default_factory=dict)
    ends: list[int] = field(default_factory=list)  # prompts that end exactly here
    pending: int = 0  # prompts in this subtree whose state has not been handed out yet
    snapshot: Prefix | None = None
    snapshot_bytes: int = 0


class PrefixTree:
    """A radix tree over token sequences (edges hold runs of tokens, a node branches or ends a sequence)."""

    def __init__(self, seqs: Sequence[Sequence[int]]):
        self.seqs = [list(s) for s in seqs]
        self.root = Node([], 0, None)
        self.end_node: list[Node] = []
        for i, s in enumerate(self.seqs):
            self.end_node.append(self._insert(i, s))

    def _insert(self, i: int, s: list[int]) -> Node:
        node, at = self.root, 0
        while True:
            node.pending += 1
            if at == len(s):
                node.ends.append(i)
                return node
            child = node.children.get(s[at])
            if child is None:
                leaf = Node(s[at:], len(s), node, pending=1, ends=[i])
                node.children[s[at]] = leaf
                return leaf
            k = 0
            while k < len(child.ids) and at + k < len(s) and child.ids[k] == s[at + k]:
                k += 1
            if k < len(child.ids):  # split the edge where the new sequence leaves it
                mid = Node(child.ids[:k], at + k, node, pending=child.pending)
                child.ids, child.parent = child.ids[k:], mid
                mid.children[child.ids[0]] = child
                node.children[s[at]] = mid
                child = mid
            node, at = child, at + k

    def nodes(self):
        todo = [self.root]
        while todo:
            n = todo.pop()
            yield n
            todo.extend(n.children.values())

    @property
    def tree_tokens(self) -> int:
        """The distinct tokens of all sequences: the least any prefill of them can compute."""
        return sum(len(n.ids) for n in self.nodes())

    def order(self) -> list[int]:
        """Sequence indices depth first (children in the order they first appeared): a subtree's sequences are
        consecutive, so its snapshot can be freed once they have started."""
        out, todo = [], [self.root]
        while todo:
            n = todo.pop()
            out += n.ends
            todo.extend(reversed(list(n.children.values())))
        return out

    def path(self, i: int) -> list[Node]:
        """The nodes from the root's first child down to where sequence ``i`` ends."""
        out, n = [], self.end_node[i]
        while n is not self.root:
            out.append(n)
            n = n.parent
        return out[::-1]


class PrefixStates:
    """Each prompt's prefilled one-row state (a ``Prefix`` whose ids are the whole prompt), computed through the
    tree's snapshots. Call ``start`` (or ``start_block``) once per prompt, in the tree's ``order()`` for the
    snapshots to pay."""

    def __init__(self, backend, tree: PrefixTree, budget_bytes: int):
        self.backend, self.budget, self.tree = backend, budget_bytes, tree
        self.used = self.peak = 0
        self.skipped = 0  # times a branch point's state did not fit the budget (its tokens recomputed below it)

    @torch.inference_mode()
    def start(self, i: int, slots=None, slot: int = 0) -> Prefix:
        """Prompt ``i``'s prefilled one-row state: its tokens below the deepest snapshot fed to a copy of it
        (that copy written into row ``slot`` of ``slots``, where given: ``MergesRows.row_slots``)."""
        held, todo = self._descend(i, strict=False)
        if todo:
            row = self._feed(held.snapshot if held is not None else None, todo, (slots, slot) if slots else None)
        else:  # the prompt ends at a kept snapshot (a duplicate, or a prefix of another prompt)
            cur = held.snapshot
            row = Prefix(list(cur.ids), self.backend.expand(cur.state, 1), cur.logits)
        self._done(i)
        return row

    @torch.inference_mode()
    def start_block(self, idx: Sequence[int]) -> tuple[list[Prefix], list[list[int]]] | None:
        """For prompts prefilled together: each one's snapshot copied into a one-row state (a ``Prefix`` of the
        snapshot's tokens) and the tokens below it, at least one, for the caller to feed as one right-padded
        block. None, with nothing computed below the snapshots, where a prompt has no snapshot above its end
        (it shares no branch point with another): those batches start row by row (``start``)."""
        bases, below = [], []
        for i in idx:  # each copy taken at once: a later prompt's descent may free a snapshot an earlier one used
            held, todo = self._descend(i, strict=True)
            if held is None:
                return None
            snap = held.snapshot
            bases.append(Prefix(list(snap.ids), self.backend.expand(snap.state, 1), snap.logits))
            below.append(todo)
        for i in idx:
            self._done(i)
        return bases, below

    def _descend(self, i: int, strict: bool) -> tuple[Node | None, list[int]]:
        """Keep a snapshot at each branch point on prompt ``i``'s path that prompts below still need (within
        the budget); return the deepest node holding one (``strict``: above the prompt's end) and the prompt's
        tokens below it."""
        path = self.tree.path(i)
        if strict:
            path = [n for n in path if n.depth < len(self.tree.seqs[i])]
        base = max((k for k, n in enumerate(path) if n.snapshot is not None), default=-1)
        held = path[base] if base >= 0 else None
        todo: list[int] = []
        for node in path[base + 1:]:
            todo += node.ids
            if node.pending >= 2:  # a branch point prompts below still need
                if self._fits(node.depth):
                    self._keep(node, self._feed(held.snapshot if held is not None else None, todo))
                    todo = []
                    if held is not None and held.pending == node.pending:  # all it served now start deeper
                        self._free(held)
                    held = node
                else:
                    self.skipped += 1
        return held, todo + self._below(i, path)

    def _below(self, i: int, path: list[Node]) -> list[int]:
        """The prompt's tokens after the last node of ``path`` (those a strict path left out)."""
        end = path[-1].depth if path else 0
        return self.tree.seqs[i][end:]

    def _done(self, i: int) -> None:
        """Prompt ``i`` has started: snapshots no pending prompt needs any more are freed."""
        for node in self.tree.path(i):
            node.pending -= 1
            if node.pending == 0:
                self._free(node)

    def _free(self, node: Node) -> None:
        if node.snapshot is not None:
            self.used -= node.snapshot_bytes
            node.snapshot = None

    def _fits(self, depth: int) -> bool:
        need = self.backend.state_bytes(depth) or 0
        return self.used + need <= self.budget

    def _keep(self, node: Node, snap: Prefix) -> None:
        node.snapshot = snap
        node.snapshot_bytes = state_nbytes(snap.state)
        self.used += node.snapshot_bytes
        self.peak = max(self.peak, self.used)
        count(self.backend, "tree_snapshots", 1)

    def _feed(self, cur: Prefix | None, ids: list[int], into: tuple | None = None) -> Prefix:
        """The state after ``ids`` following ``cur`` (a fresh copy, written into ``into``'s slots and row where
        given; ``cur`` stays as it was), one row, unpadded."""
        b = self.backend
        t = torch.tensor([ids], device=b.device)
        if cur is None:
            logits, state = b.prefill(t, torch.ones_like(t))
            full = list(ids)
        else:
            state = b.expand(cur.state, 1)
            if into is not None:
                b.place(state, *into)
            full = cur.ids + list(ids)
            logits = b.extend(state, ids, len(cur.ids))
        count(self.backend, "prefill_tokens", len(ids))
        return Prefix(full, state, logits)


def default_budget(device: torch.device) -> int:
    """Bytes snapshots may hold when ``--prefix-memory`` is auto: a quarter of the device's free memory (the
    batches' own budget is half of it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.25)
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pages = 8 << 30
    return int(pages * 0.25)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``4GiB``, ``512MB``, ``1e9`` → bytes; ValueError names the accepted forms."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value >= 0:
        raise ValueError(f"{text!r} is not an amount of memory; use e.g. 4GiB, 512MiB, 2GB or auto")
    return int(value * _UNITS[unit])
