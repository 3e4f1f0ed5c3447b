"""What the trainer feeds the model: a task's token sequences as padded batches with their loss masks, drawn
from seeded streams so that neither the number of data workers nor a resume changes a single sample."""
from __future__ import annotations

import random

import torch

from evals import get_task, task_class
from evals.base import word_level_tokenizer
from evals.synthetic import PAD, loss_mask
from harness.models.packing import one_row_on, packed_tokens
from harness.backends.generation import pad_batch
from harness.hashing import digest
from harness.training.config import TrainConfig

# The validation split's ``eval_seed`` is the test split's plus this: far from the small seeds people pass to
# evaluate on another held-out set.
VALIDATION_SEED_OFFSET = 1_000_003


class TrainTask:
    """The task a run trains on, built from the run's flags through the task's own training protocol
    (``evals.base.SyntheticTask``): its vocabulary, a fresh-sample stream, a length bound, held-out sequences,
    and the options under which the eval engine re-creates it (icr_task.json next to the checkpoint)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.eval_args = {**task_class(cfg.task).training_options(cfg), "samples": cfg.eval_samples}
        self.impl = get_task(cfg.task, **self.eval_args)
        self.vocab = self.impl.vocabulary()
        self.max_len = self.impl.training_max_len()

    def stream(self, seed: int):
        return self.impl.stream(seed)

    def heldout(self) -> list[list[str]]:
        """The test split: the live evaluation's held-out samples as whole training sequences (gold trace and
        tool results included), what the reported teacher-forced exact match is computed on."""
        return self.impl.heldout_sequences(self.impl.load())

    def validation(self) -> list[list[str]]:
        """The validation split, where ``--checkpoint best`` compares checkpoints: drawn as the test split is,
        from its own seed, with every sequence that the test split also holds removed (tiny graphs repeat), so
        the number reported on the test split never comes from a checkpoint chosen on the same samples."""
        seed = self.impl.options.eval_seed + VALIDATION_SEED_OFFSET
        impl = get_task(self.cfg.task, **{**self.eval_args, "eval_seed": seed})
        test = {tuple(s) for s in self.heldout()}
        return [s for s in impl.heldout_sequences(impl.load()) if tuple(s) not in test]

    def tokenizer(self):
        return word_level_tokenizer(self.vocab)


def batch_from_tokens(samples: list[list[str]], vocab: dict[str, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the loss mask (targets after the first [EOS], no tool results, no padding)."""
    ids, _ = pad_batch([[vocab[t] for t in s] for s in samples], vocab[PAD], device, side="right")
    targets, _ = pad_batch([loss_mask(s) for s in samples], 0, device, side="right")
    return ids, targets.float()


class TrainingBatches(torch.utils.data.IterableDataset):
    """Endless pools of batches (``bucket`` batches a pool): fresh samples, or samples of a token ``store``.
    Pool ``k`` depends on (seed, process, k) alone, so the data depend on neither the number of DataLoader
    workers nor where a run was resumed: ``start_pool`` skips to any position at no cost. Fresh batches come
    from a stream seeded by (seed, process, batch); store batches are positions of one global sequence (every
    process's batches in turn) that visits the store in a seeded order per epoch. Worker ``w`` of ``W`` draws
    pools start+w, start+w+W, ...; the DataLoader takes its workers' items in turn, so pools arrive in order,
    made off the training loop's critical path."""

    def __init__(self, task: TrainTask, batch: int, seed: int, process: int, bucket: int = 1, start_pool: int = 0,
                 store=None, processes: int = 1):
        self.task, self.batch, self.seed, self.process, self.bucket = task, batch, seed, process, bucket
        self.start_pool, self.store, self.processes = start_pool, store, processes
        self.vocab = {t: i for i, t in enumerate(task.vocab)}
        self._orders: dict[int, object] = {}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        pool = self.start_pool + worker
        while True:
            yield self.pool(pool)
            pool += workers

    def pool(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``index * bucket`` ... : fresh samples, each batch from its own seeded stream, or store samples
        at their positions of the global sequence (bucketing regroups the same samples; it never changes them)."""
        batches = range(index * self.bucket, (index + 1) * self.bucket)
        if self.store is None:
            streams = (self.task.stream(seed=_batch_seed(self.seed, self.process, b)) for b in batches)
            samples = [next(stream) for stream in streams for _ in range(self.batch)]
            length, make = len, lambda g: batch_from_tokens(g, self.vocab, "cpu")
        else:
            firsts = [(b * self.processes + self.process) * self.batch for b in batches]
            samples = [self._at(k) for first in firsts for k in range(first, first + self.batch)]
            length, make = self.store.lengths.__getitem__, self.store.batch
        if self.bucket > 1:  # sorted by length, then the batches in a seeded random order
            samples.sort(key=length)
        groups = [samples[i:i + self.batch] for i in range(0, len(samples), self.batch)]
        random.Random(f"bucket:{self.seed}:{self.process}:{index}").shuffle(groups)
        return [make(g) for g in groups]

    def _at(self, position: int) -> int:
        """The store sample at ``position`` of the global sequence: epoch by epoch, each in its own order."""
        epoch, k = divmod(position, len(self.store))
        if epoch not in self._orders:
            self._orders = {epoch: self.store.order(epoch, self.seed)}  # one epoch held at a time
        return int(self._orders[epoch][k])


def _batch_seed(seed: int, process: int, batch: int) -> int:
    return int.from_bytes(bytes.fromhex(digest(f"train:{seed}:{process}:{batch}", length=16)), "little")


PACKING_GAIN = 0.9  # auto packs a cell whose batches compute at most this share of their padded tokens packed


def packing_share(task: TrainTask, batch: int, seed: int, draws: int = 8, one_row: bool = False) -> float:
    """Tokens a packed step computes over the padded step's, on the cell's first ``draws`` batches (the run's
    seed: what ``--packing auto`` decides by, the same answer on every resume)."""
    source = TrainingBatches(task, batch, seed, 0)
    pad = task.vocab.index(PAD)
    packed = padded = 0
    for k in range(draws):
        for ids, _ in source.pool(k):
            p, q = packed_tokens(ids, pad, one_row)
            packed, padded = packed + p, padded + q
    return packed / padded


def packing_setting(cfg, task: TrainTask, batch: int, device_type: str = "cpu") -> tuple[str, float | None]:
    """(``on`` or ``off``, the packed share of tokens where measured) for ``--packing`` of this cell on
    ``device_type``, its batches laid out as ``pack`` lays them out there (``one_row_on``)."""
    # auto packs on a CPU only. There each sample attends causally to itself alone (``masks.per_sample_attention``;
    # a dense block mask ran a Transformer's packed step at 0.95x the padded one, n=32 retrieval, batch 8).
    # On a GPU the Triton scan walks each row's length in turn, so fewer rows of the same width save little, and
    # the packed step ran 0.85-0.88x the padded one for the 0.5M Mamba at n=64 retrieval, batch 64, on an H100 (the
    # hybrid: 0.45-0.72x, its attention then on a dense block mask); 1.02-1.09x at 1M and 2M (docs/results/packing.md).
    # Not yet timed with the scan's time in splits and packed attention in one varlen call: the quick suite's
    # "packed rows" rows say whether a GPU should pack too.
    if cfg.packing == "off" or (cfg.packing == "auto" and device_type != "cpu"):
        return "off", None
    share = packing_share(task, batch, cfg.seed, one_row=one_row_on(device_type))
    return ("on" if cfg.packing == "on" or share <= PACKING_GAIN else "off"), round(share, 4)

