"""``GrowingLayer``: transformers' ``DynamicLayer`` with spare capacity gives the concatenating cache's logits,
through prefill, decode steps past its spare room, a dropped row and repeated rows; rows merged from several
caches land in one buffer with room for the steps to come."""
import copy

import torch
from transformers import DynamicCache

from harness.backends import growing_cache
from harness.backends.base import state_nbytes
from harness.backends.families import join_rows, map_rows, merge_rows


@torch.inference_mode()
def test_growing_cache_gives_the_concatenating_caches_logits(phi_backend):
    model = phi_backend.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 900, (3, 40), generator=gen)
    steps = torch.randint(5, 900, (3, growing_cache.SPARE + 30), generator=gen)  # past the spare room: it grows
    out = {}
    for grow in (False, True):
        cache = DynamicCache(config=model.config)
        if grow:
            growing_cache.install(cache)
        logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        rows = torch.arange(3)
        for t in range(steps.shape[1]):
            if t == 20:  # a row leaves the batch, then the rest are repeated (the shared-prefix copy)
                rows = torch.tensor([0, 2])
                map_rows(cache, lambda x: x.index_select(0, torch.tensor([0, 2])))
            if t == 40:
                rows = rows.repeat_interleave(2)
                map_rows(cache, lambda x: x.repeat_interleave(2, dim=0))
            logits.append(model(input_ids=steps[rows, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        out[grow] = logits
        if grow:
            assert type(cache.layers[0]).__name__ == "GrowingLayer"
            assert cache.layers[0]._k.shape[-2] > cache.layers[0].keys.shape[-2]  # spare room, not a copy a step
    assert len({int(x[0].argmax()) for x in out[False]}) > 1  # the logits move from step to step
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_the_state_a_growing_cache_holds_is_its_filled_part_not_its_spare_room(phi_backend):
    """``state_bytes`` is the paper's memory axis (samples.jsonl, the demo, the trainer's result.json): the keys
    and values of the tokens seen, the same as the concatenating cache holds, whatever capacity is allocated."""
    model = phi_backend.model
    ids = torch.randint(5, 900, (1, 40), generator=torch.Generator().manual_seed(1))
    _, state = phi_backend.prefill(ids, torch.ones_like(ids))
    layer = state["cache"].layers[0]
    assert type(layer).__name__ == "GrowingLayer" and layer._k.shape[-2] > layer.keys.shape[-2]  # room to spare
    plain = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=plain, use_cache=True)
    assert state_nbytes(state["cache"]) == state_nbytes(plain) > 0
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # float32 K, V
    pos = state["pos"].numel() * state["pos"].element_size()
    assert phi_backend.state_bytes(40) == 40 * per_token + pos
    assert phi_backend.state_bytes(100) == 100 * per_token + pos


@torch.inference_mode()
def test_rows_merged_into_a_growing_layer_decode_in_its_buffer_and_equal_the_concatenated_rows(phi_backend):
    """The prefix tree's merge (rows of other lengths, left-padded) and a join that cuts masked positions write
    each layer's rows once into a buffer with ``SPARE`` positions past them: the next steps write in place (the
    buffer is not reallocated), and its keys and values are the padded rows concatenated, to the bit."""
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(5, 900, (1, n), generator=gen) for n in (30, 41, 37)]
    states = [phi_backend.prefill(ids, torch.ones_like(ids))[1]["cache"] for ids in rows]
    width = max(ids.shape[1] for ids in rows)
    expected = [torch.cat([torch.nn.functional.pad(getattr(c.layers[0], name), (0, 0, width - ids.shape[1], 0))
                           for c, ids in zip(states, rows)]) for name in ("keys", "values")]
    merged = merge_rows(states, [ids.shape[1] for ids in rows])
    layer = merged.layers[0]
    assert torch.equal(layer.keys, expected[0]) and torch.equal(layer.values, expected[1])
    assert expected[0][:, :, -1].std() > 0.1  # the rows' keys vary
    assert layer._k.shape[-2] == width + growing_cache.SPARE and layer._v.shape[-2] == width + growing_cache.SPARE
    buffer = layer._k.data_ptr()
    step = torch.randint(5, 900, (3, 1), generator=gen)
    phi_backend.model(input_ids=step, past_key_values=merged, use_cache=True)
    assert layer._k.data_ptr() == buffer and layer.keys.shape[-2] == width + 1  # written in place
    before, extra = layer.keys.clone(), phi_backend.prefill(rows[0], torch.ones_like(rows[0]))[1]["cache"]
    extra_keys = extra.layers[0].keys.clone()
    # a join: the running batch loses 5 positions masked in all its rows, the joining row is padded to its width
    joined = join_rows([merged, extra], [(width + 1, 5, 0), (30, 0, width + 1 - 5 - 30)])
    keys = joined.layers[0].keys
    assert keys.shape[0] == 4 and keys.shape[-2] == width - 4
    assert torch.equal(keys[:3], before[:, :, 5:])
    assert torch.equal(keys[3:], torch.nn.functional.pad(extra_keys, (0, 0, width - 4 - 30, 0)))
    assert joined.layers[0]._k.shape[-2] == width - 4 + growing_cache.SPARE


@torch.inference_mode()
def test_a_prefix_state_repeated_once_shares_its_keys_until_a_row_writes_its_own(phi_backend):
    """``StepModel.expand`` of a prefix tree's snapshot into one row: the row reads the snapshot's keys and values
    where they lie, and its next update writes a buffer of its own, never the snapshot's room; its logits are a
    copied snapshot's. (Recurrent states are copied: the family matrix's plans, ``tests/test_families.py``.)"""
    gen = torch.Generator().manual_seed(2)
    ids, more = torch.randint(5, 900, (1, 30), generator=gen), torch.randint(5, 900, (1, 12), generator=gen)
    _, snapshot = phi_backend.prefill(ids, torch.ones_like(ids))
    parent = snapshot["cache"].layers[0]
    before = parent.keys.clone()
    rows = [phi_backend.expand(snapshot, 1) for _ in range(2)]
    child = rows[0]["cache"].layers[0]
    assert child.keys.data_ptr() == parent.keys.data_ptr() and child._k.shape[-2] == child.keys.shape[-2] == 30
    mask = torch.ones(1, 42, dtype=torch.long)
    logits = [phi_backend.step(r, more[:, 6 * i:6 * i + 6], mask[:, :36]) for i, r in enumerate(rows)]
    assert child.keys.data_ptr() != parent.keys.data_ptr() and torch.equal(parent.keys, before)
    assert torch.equal(child.keys[..., :30, :], before)  # what the snapshot held, copied once
    copied = {"cache": copy.deepcopy(snapshot["cache"]), "pos": snapshot["pos"].clone()}
    assert torch.equal(logits[0], phi_backend.step(copied, more[:, :6], mask[:, :36]))
    assert not torch.equal(logits[0], logits[1])  # two rows fed different tokens: the comparison can fail
    many = phi_backend.expand(snapshot, 3)["cache"].layers[0]  # several rows: copies
    assert many.keys.shape[0] == 3 and many.keys.data_ptr() != parent.keys.data_ptr()
