"""The hybrid's KV cache: written in place into a preallocated buffer vs concatenated every step, and the
fixed-capacity cache CUDA graphs replay, resident vs copied in every step.

    python benchmarks/kv_cache.py [--lengths 512,2048,8192] [--steps 64] [--hidden 256 --layers 4]

A random-weight Hybrid-Phi-Mamba (attention in half its layers) is prefilled with each context length, then
decodes ``--steps`` greedy tokens four ways: with the project's cache; with attention layers that ``torch.cat``
the new key/value onto the cache at every step (the previous implementation, which copies the whole cache per
step); through the CUDA-graph decoder's static buffers (run eagerly, without capture), where the cache stays
resident; and the same with the cache handed over fresh every step, as a decoder without residency would copy
it in. Prints ms per decode step side by side and checks the greedy tokens are identical."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from harness.models.decode_graphs import GraphedDecode
from harness.models.masks import block_attention_mask
from harness.models.phi_mamba import PhiAttentionMixer, PhiMambaConfig, PhiMambaForCausalLM
from harness.tools.bench import benchmark_parser


def concat_forward(self, u, full_mask, state, pos):
    """The attention step as it was: a new cache tensor every step."""
    b, l, _ = u.shape
    sa = self.self_attn
    q, k, v = (getattr(sa, n)(u).view(b, l, self.heads, self.head_dim).transpose(1, 2)
               for n in ("q_proj", "k_proj", "v_proj"))
    q, k = self._rotate(q, pos), self._rotate(k, pos)
    state["k"] = k = torch.cat([state["k"][:, :, : state["len"]], k], dim=2)
    state["v"] = v = torch.cat([state["v"][:, :, : state["len"]], v], dim=2)
    state["len"] = k.shape[2]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=block_attention_mask(full_mask, l))
    return sa.dense(out.transpose(1, 2).reshape(b, l, -1))


def plain_step(model):
    return lambda state, nxt, mask: model(nxt, mask, state)[0][:, -1]


def fresh_kv(state):
    """Hand the decoder a cache it does not hold (a copy made outside the timer): it must copy it in."""
    for layer in state.layers:
        if "k" in layer:
            layer.update(k=layer["k"].clone(), v=layer["v"].clone())


@torch.no_grad()
def decode(model, prompt, steps, step, before_step=None):
    mask = torch.ones_like(prompt)
    logits, state = model(prompt, mask, logits_to_keep=1)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    tokens, seconds = [int(nxt)], 0.0
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        if before_step is not None:
            before_step(state)
        t0 = time.perf_counter()
        nxt = step(state, nxt, mask).argmax(-1, keepdim=True)
        seconds += time.perf_counter() - t0
        tokens.append(int(nxt))
    return tokens, 1000 * seconds / steps


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = PhiMambaConfig.tiny(1000, d_model=a.hidden, n_layer=a.layers, attn_layers=tuple(range(1, a.layers, 2)))
    model = PhiMambaForCausalLM(cfg).eval()
    print(f"hybrid d={a.hidden}, {a.layers} layers (attention in {list(cfg.attn_layers)}), CPU threads "
          f"{torch.get_num_threads()}, {a.steps} decode steps\n")
    print(f"{'context':>8s} {'in place ms':>12s} {'torch.cat ms':>13s} {'cat / in place':>15s} {'static ms':>10s} "
          f"{'copied-in ms':>13s} {'copied / static':>16s}  same tokens")
    for length in map(int, a.lengths.split(",")):
        prompt = torch.randint(0, 1000, (1, length))
        ours, t_ours = decode(model, prompt, a.steps, plain_step(model))
        PhiAttentionMixer.forward, saved = concat_forward, PhiAttentionMixer.forward
        try:
            cat, t_cat = decode(model, prompt, a.steps, plain_step(model))
        finally:
            PhiAttentionMixer.forward = saved
        static, t_static = decode(model, prompt, a.steps, GraphedDecode(model, capture=False))
        copied, t_copied = decode(model, prompt, a.steps, GraphedDecode(model, capture=False), fresh_kv)
        print(f"{length:8d} {t_ours:12.2f} {t_cat:13.2f} {t_cat / t_ours:14.2f}x {t_static:10.2f} {t_copied:13.2f} "
              f"{t_copied / t_static:15.2f}x  {ours == cat == static == copied}")


if __name__ == "__main__":
    main()
