"""A fixed set of training samples, generated once ahead of time into a memory-mapped token store that every
run with the same data reads (the paper's code reuses one set of 1,000,000 samples for its 5M-sample runs).

Generating IsTree samples in Python took 57% of a Transformer step at n=64 retrieval on an H200; read from the
store, a batch is a few array slices. A store is keyed by its content (the task, its options and the sample
count, and the vocabulary the ids index), built in worker processes in shards whose samples depend on the shard alone (so neither the worker
count nor a crashed build changes a sample), written to a temporary folder and renamed into place under a file
lock: two cells that need the same store build it once, and a half-written store is never read. Opening a store
checks it is the one asked for (its key, the vocabulary included: ids read under another vocabulary are other
tokens) and whole (meta.json's own hash, every file's size and SHA-256 through the file-hash cache, so a multi-GB
store is hashed once, not every run): another store put in its place is refused, a damaged one (an edited
meta.json, a file rewritten even at the same size, a store of an older format that recorded no hashes) is moved
aside and rebuilt (its samples depend on the key alone, so a resumed run reads the same data).

  meta.json      the key (vocabulary included), the count, each file's SHA-256, and meta_sha256: the hash of
                 meta.json's other fields (written last: a folder without it is not a store)
  tokens.bin     every sample's token ids, back to back (uint8 when the vocabulary fits, else uint16)
  masks.bin      the loss mask of every token (uint8), aligned with tokens.bin
  offsets.npy    where each sample starts (int64, one more entry than samples)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from evals.synthetic import loss_mask
from harness.cache import FileHashCache
from harness.hashing import json_digest
from harness.procs import child_context

log = logging.getLogger("harness")

SHARD = 2048  # samples a build worker draws from one seeded stream
FORMAT = 2  # 2: the vocabulary in the key, meta.json hashed, every file hashed
FILES = ("tokens.bin", "masks.bin", "offsets.npy")


class StoreError(ValueError):
    """A folder where a store should be holds something else; the message names the folder and the fix."""


class TokenStore:
    """A built store, opened read-only as memory maps (reopened in each DataLoader worker)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.vocab: list[str] = self.meta["vocab"]
        self.pad = self.vocab.index("[PAD]")
        self._open()

    def _open(self):
        dtype = np.dtype(self.meta["dtype"])
        self.offsets = np.load(self.path / "offsets.npy")
        self.tokens = np.memmap(self.path / "tokens.bin", dtype=dtype, mode="r")
        self.masks = np.memmap(self.path / "masks.bin", dtype=np.uint8, mode="r")
        self.lengths = np.diff(self.offsets)

    def __getstate__(self):
        return {"path": self.path, "meta": self.meta, "vocab": self.vocab, "pad": self.pad}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and loss masks of these samples, as ``data.batch_from_tokens`` makes them."""
        width = int(self.lengths[indices].max())
        ids = np.full((len(indices), width), self.pad, dtype=np.int64)
        mask = np.zeros((len(indices), width), dtype=np.float32)
        for row, i in enumerate(indices):
            a, b = self.offsets[i], self.offsets[i + 1]
            ids[row, :b - a] = self.tokens[a:b]
            mask[row, :b - a] = self.masks[a:b]
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def order(self, epoch: int, seed: int) -> np.ndarray:
        """The seeded order in which epoch ``epoch`` visits the samples (a fresh permutation each epoch)."""
        return np.random.default_rng([seed, epoch]).permutation(len(self))


def store_key(task, samples: int) -> dict:
    """What decides a store's content: the task, the options its samples are drawn with, the vocabulary its ids
    index (a generator whose vocabulary order changed writes other ids for the same samples) and the count."""
    options = {k: v for k, v in task.eval_args.items() if k not in ("samples", "eval_seed")}
    return {"format": FORMAT, "task": task.cfg.task, "options": options, "vocab": list(task.vocab),
            "samples": samples}


def _meta_digest(meta: dict) -> str:
    """meta.json's hash over every field but its own: an edit to the vocabulary, a count or a file hash shows."""
    return json_digest({k: v for k, v in meta.items() if k != "meta_sha256"}, length=None)


def ensure_store(task, samples: int, root: Path, workers: int = 0) -> TokenStore:
    """The store of ``samples`` samples of ``task`` under ``root``, built first if no run has built it (or if the
    one there is damaged); another store in its place is refused."""
    from filelock import FileLock

    key = store_key(task, samples)
    path = Path(root) / f"{task.cfg.task}-{json_digest(key)}"
    if (path / "meta.json").exists() and _check(path, key) is None:
        return TokenStore(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", mode=0o666):
        for stale in path.parent.glob(f".building-{path.name}-*"):  # a build killed before it could clean up
            shutil.rmtree(stale, ignore_errors=True)
        damage = _check(path, key) if (path / "meta.json").exists() else "absent"
        if damage not in (None, "absent"):
            aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            log.warning("token store %s is damaged (%s): moved to %s and built again", path, damage, aside)
            os.replace(path, aside)
        if damage is not None:
            _build(task, key, path, workers)
    return TokenStore(path)


def _check(path: Path, key: dict) -> str | None:
    """What is wrong with the store in ``path`` (None: it is the store of ``key``, whole). Raises StoreError for a
    store of other data: that is not damage to repair but a folder someone put there."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable: {e}"
    if not isinstance(meta, dict):
        return f"meta.json holds a JSON {type(meta).__name__}, not a store's record"
    if meta.get("format") != FORMAT or not isinstance(meta.get("sha256"), dict) \
            or set(meta["sha256"]) != set(FILES) or "meta_sha256" not in meta:
        return (f"a store of format {meta.get('format')!r} (this version writes {FORMAT}), without a hash of every "
                f"file and of meta.json: it cannot be checked")
    if meta["meta_sha256"] != _meta_digest(meta):
        return "meta.json was changed after the store was built (its hash differs)"
    key = json.loads(json.dumps(key))  # as meta.json holds it (tuples as lists)
    found = {k: meta.get(k) for k in key}
    if found != key:
        differ = ", ".join(_difference(k, found.get(k), key[k]) for k in key if found.get(k) != key[k])
        raise StoreError(f"token store {path} holds other data than this run's: {differ}. A store's folder is "
                         f"named by its content; move that folder away (or delete it) and rerun to build this "
                         f"run's store there")
    itemsize = np.dtype(meta.get("dtype", "uint8")).itemsize
    want = {"tokens.bin": meta.get("tokens", -1) * itemsize, "masks.bin": meta.get("tokens", -1),
            "offsets.npy": None}
    hashes = meta["sha256"]
    cache = FileHashCache()
    for name in FILES:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if want[name] is not None and file.stat().st_size != want[name]:
            return f"{name} has {file.stat().st_size} bytes, not {want[name]}"
        if cache.sha256(file) != hashes[name]:
            return f"{name} is not the file that was built (SHA-256 differs)"
    try:
        offsets = np.load(path / "offsets.npy")
    except (OSError, ValueError, EOFError) as e:
        return f"offsets.npy unreadable: {e}"
    if len(offsets) != key["samples"] + 1 or int(offsets[-1]) != meta.get("tokens"):
        return f"offsets.npy holds {len(offsets) - 1} samples of {int(offsets[-1])} tokens, not {key['samples']}"
    return None


def _difference(field: str, found, wanted) -> str:
    if field == "vocab" and isinstance(found, list):
        moved = [i for i, (a, b) in enumerate(zip(found, wanted)) if a != b]
        where = f"first at id {moved[0]}: {found[moved[0]]!r} there, {wanted[moved[0]]!r} here" if moved else \
            f"{len(found)} tokens there, {len(wanted)} here"
        return f"vocab differs ({where})"
    return f"{field} {found!r} (this run: {wanted!r})"


def _build(task, key: dict, path: Path, workers: int) -> None:
    vocab = key["vocab"]
    dtype = np.uint8 if len(vocab) <= 256 else np.uint16
    count = key["samples"]
    jobs = [(task.impl, key, shard, vocab, dtype, min(SHARD, count - shard * SHARD))
            for shard in range(-(-count // SHARD))]
    tmp = Path(tempfile.mkdtemp(prefix=f".building-{path.name}-", dir=path.parent))
    try:
        with _pool(workers) as pool:
            shards = pool.imap(_draw_shard, jobs) if pool else map(_draw_shard, jobs)
            lengths = []
            with open(tmp / "tokens.bin", "wb") as tokens, open(tmp / "masks.bin", "wb") as masks:
                for shard_tokens, shard_masks, shard_lengths in shards:  # in shard order, whatever the workers
                    shard_tokens.tofile(tokens)
                    shard_masks.tofile(masks)
                    lengths.append(shard_lengths)
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
        np.save(tmp / "offsets.npy", offsets)
        cache = FileHashCache()
        meta = {**key, "dtype": np.dtype(dtype).name, "tokens": int(offsets[-1]),
                "sha256": {name: cache.sha256(tmp / name) for name in FILES}}
        meta["meta_sha256"] = _meta_digest(meta)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _share(tmp)
        if path.exists():  # a half-built folder of a killed build (no meta.json): replaced
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _share(folder: Path) -> None:
    """The permissions a folder made normally would have (``mkdtemp`` makes it private): a store in a cache that
    a group shares is readable by that group, as far as the user's umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def _pool(workers: int):
    """Worker processes for a build (terminated however it ends), or none: drawn in this process."""
    if workers <= 1:
        return contextlib.nullcontext()

    return child_context(cuda=False, preload=(__name__,)).Pool(workers)  # they draw samples: no CUDA


def _draw_shard(job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One shard's samples as token ids, loss masks and lengths (arrays: a million samples of thousands of
    tokens would not fit as Python lists)."""
    impl, key, shard, vocab, dtype, count = job
    ids = {t: i for i, t in enumerate(vocab)}
    stream = impl.stream(seed=shard_seed(key, shard))
    samples = [next(stream) for _ in range(count)]
    tokens = np.fromiter((ids[t] for s in samples for t in s), dtype=dtype)
    masks = np.fromiter((m for s in samples for m in loss_mask(s)), dtype=np.uint8)
    return tokens, masks, np.array([len(s) for s in samples], dtype=np.int64)


def shard_seed(key: dict, shard: int) -> int:
    """The seed of one shard's stream: from what decides which samples are drawn (task, options, count), as format
    1 seeded it, so a store rebuilt in a later format holds the same samples and an older run resumes on them."""
    drawn = {"format": 1, **{k: key[k] for k in ("task", "options", "samples")}}
    return int(json_digest({"store": drawn, "shard": shard}), 16)
