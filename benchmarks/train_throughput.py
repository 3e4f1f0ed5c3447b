"""Training throughput (samples/s) per architecture on this machine, side by side in one run.

    python benchmarks/train_throughput.py [--size 0.5M] [--nodes 8] [--setups cot,retrieval] [--steps 5]

Same data stream, batch and sequence lengths for each architecture; one warm-up step, then ``--steps`` timed
optimizer steps (forward, backward, AdamW). Ratios are to the Transformer."""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from evals import istree
from harness.istree_models import ARCHS, build_model, trainable_parameters
from harness.train import batch_from_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.5M")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--setups", default="cot,retrieval")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    vocab_list = istree.vocabulary(a.nodes)
    vocab = {t: i for i, t in enumerate(vocab_list)}
    print(f"size {a.size}, n={a.nodes}, batch {a.batch_size}, {a.steps} timed steps, CPU threads "
          f"{torch.get_num_threads()}\n")
    print(f"{'setup':10s} {'arch':12s} {'params':>10s} {'tokens/sample':>14s} {'samples/s':>10s} {'vs transformer':>15s}")
    for setup in a.setups.split(","):
        data = istree.stream(a.nodes, setup, "binary", seed=0)
        batches = [[next(data) for _ in range(a.batch_size)] for _ in range(a.steps + 1)]
        mean_len = sum(len(s) for b in batches for s in b) / sum(len(b) for b in batches)
        base = None
        for arch in ARCHS:
            torch.manual_seed(0)
            model = build_model(arch, a.size, len(vocab_list))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            for i, b in enumerate(batches):
                if i == 1:
                    t0 = time.perf_counter()
                ids, mask = batch_from_tokens(b, vocab, "cpu")
                logits = model(input_ids=ids).logits[:, :-1]
                loss = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                        reduction="none") * mask[:, 1:].reshape(-1)).sum() / mask.sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
            rate = a.steps * a.batch_size / (time.perf_counter() - t0)
            base = base or rate
            print(f"{setup:10s} {arch:12s} {trainable_parameters(model):10,d} {mean_len:14.1f} {rate:10.1f} "
                  f"{rate / base:14.2f}x")


if __name__ == "__main__":
    main()
