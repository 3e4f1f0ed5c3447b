"""What the transformers backend changes in a checkpoint's forward for speed, each measured against the forward
it replaces: the additive 4D mask built once a forward (equal to transformers' boolean mask to the bit), GELU's
tanh form as one kernel (equal to float32 rounding, recorded in results.json), a CPU's long query blocks attending
in chunks (equal to float32 rounding, recorded too) or, where the machine's products take oneDNN, through them
(equal to float32 rounding), and a CPU's token budget (the tree's rows decode in one batch
where memory allows)."""
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.activations import NewGELUActivation

from harness.backends import chunked_attention, memory, onednn_linear
from harness.backends.additive_mask import additive_mask
from harness.backends.hf import TransformersBackend
from harness.tiny import make_tiny_model


@pytest.fixture(scope="module")
def gpt2_backend(tiny_tokenizer):
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(Path(d) / "gpt2", "gpt2", tokenizer=tiny_tokenizer)
        yield TransformersBackend(str(path), device="cpu", dtype="float32")


@torch.inference_mode()
def _paths(backend, gen):
    """Logits of a left-padded prefill, a right-padded block after it, a one-token step, and a run extended
    after a copied prefix (the prefix tree's path)."""
    ids = torch.randint(5, 900, (3, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :2] = 0
    block, step, run = (torch.randint(5, 900, s, generator=gen) for s in ((3, 5), (3, 1), (9,)))
    logits, state = backend.prefill(ids, mask)
    out = [logits]
    mask = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], 1)
    mask[2, -2:] = 0  # the third row's block is two tokens shorter
    out.append(backend.step(state, block, mask))
    out.append(backend.step(state, step, torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)))
    _, alone = backend.prefill(ids[:1, 7:], torch.ones_like(ids[:1, 7:]))
    copied = backend.expand(alone, 1)
    out.append(backend.extend(copied, run.tolist(), 33))
    return out


@pytest.mark.parametrize("name", ["phi_backend", "llama_backend", "gpt2_backend"])
def test_the_additive_mask_built_once_gives_transformers_masks_logits_to_the_bit(name, request, monkeypatch):
    monkeypatch.setenv("ICR_CPU_FLASH", "off")  # the same kernels on both sides: the mask is what is compared
    backend = request.getfixturevalue(name)
    assert backend.additive_masks
    out = {}
    try:
        for built in (False, True):
            backend.additive_masks = built
            out[built] = _paths(backend, torch.Generator().manual_seed(3))
    finally:
        backend.additive_masks = True
    for plain, built in zip(out[False], out[True]):
        assert plain.shape[0] == 1 or len({int(i) for i in plain.argmax(-1)}) > 1  # the rows differ
        assert torch.equal(plain, built)


def test_the_additive_mask_is_causal_padded_and_left_to_sdpa_where_transformers_builds_none():
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    built = additive_mask(mask, 2, torch.float32)
    low = torch.finfo(torch.float32).min
    assert built.shape == (2, 1, 2, 5)
    assert built[0, 0].tolist() == [[low, 0, 0, 0, low], [low, 0, 0, 0, 0]]  # the pad, and the next key unseen
    assert built[1, 0].tolist() == [[0, 0, 0, 0, low], [0, 0, 0, 0, 0]]
    full = torch.ones(2, 5, dtype=torch.long)
    assert additive_mask(full, 5, torch.float32) is full and additive_mask(full, 1, torch.float32) is full
    unpadded = additive_mask(full, 2, torch.float32)  # queries after cached keys: a mask, the triangle alone
    assert unpadded.shape == (2, 1, 2, 5) and unpadded.is_contiguous()
    assert unpadded[0, 0].tolist() == unpadded[1, 0].tolist() == [[0, 0, 0, 0, low], [0, 0, 0, 0, 0]]
    assert not torch.signbit(unpadded).logical_and(unpadded == 0).any()  # +0, as the padded path's where gives


@torch.inference_mode()
def test_fused_gelu_replaces_the_python_one_and_rounds_within_float32(tiny_phi_dir):
    backend = TransformersBackend(str(tiny_phi_dir), device="cpu", dtype="float32")
    stock = AutoModelForCausalLM.from_pretrained(str(tiny_phi_dir), dtype=torch.float32).eval()
    onednn_linear.use_onednn(stock, torch.device("cpu"), torch.float32)  # the backend's linear kernel: only GELU
    # differs between the two
    layers = stock.config.num_hidden_layers
    assert backend.fused[0] == f"NewGELUActivation x{layers} -> gelu(approximate='tanh')"
    assert not any(isinstance(m, NewGELUActivation) for m in backend.model.modules())
    assert sum(isinstance(m, NewGELUActivation) for m in stock.modules()) == layers
    assert backend.describe().to_json()["fused"] == backend.fused
    ids = torch.randint(5, 900, (2, 30), generator=torch.Generator().manual_seed(0))
    fused, plain = backend.model(input_ids=ids).logits, stock(input_ids=ids).logits
    assert len({int(i) for i in plain[0].argmax(-1)}) > 1  # the logits move along the sequence
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_a_cpu_token_budget_follows_free_memory_between_its_bounds(phi_backend, monkeypatch):
    low, high = memory.CPU_TOKENS
    monkeypatch.setattr(memory, "available_memory", lambda: 64 * 2**30)
    assert memory.token_budget(phi_backend) == high  # a tiny model: every row of a sweep in one batch
    monkeypatch.setattr(memory, "available_memory", lambda: 2**30)
    assert memory.token_budget(phi_backend) == low
    monkeypatch.setattr(memory, "available_memory", lambda: None)
    assert memory.token_budget(phi_backend) == low
    monkeypatch.undo()
    assert memory.available_memory() > 0  # read from this machine (Linux's /proc/meminfo)


@torch.inference_mode()
def _long_paths(backend, gen):
    """Blocks long enough to attend in chunks: a left-padded two-row prefill, a right-padded block after it, and a
    run extended after a copied prefix; the last position's logits of each."""
    ids = torch.randint(5, 900, (2, 800), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :90] = 0
    logits, state = backend.prefill(ids, mask)
    out = [logits]
    block = torch.randint(5, 900, (2, 780), generator=gen)
    mask = torch.cat([mask, torch.ones_like(block)], 1)
    mask[0, -5:] = 0
    out.append(backend.step(state, block, mask))
    _, alone = backend.prefill(ids[:1, :150], torch.ones_like(ids[:1, :150]))
    out.append(backend.extend(backend.expand(alone, 1), torch.randint(5, 900, (900,), generator=gen).tolist(), 150))
    return out


@pytest.mark.parametrize("name", ["phi_backend", "llama_backend", "gpt2_backend"])
def test_long_blocks_attending_in_chunks_equal_one_sdpa_call(name, request, monkeypatch):
    """On a CPU a block of >= MIN_QUERIES queries attends one chunk at a time over the keys each chunk can see:
    the same logits as one SDPA call to float32 rounding, on a padded prefill, a padded block and an extend."""
    monkeypatch.setenv("ICR_CPU_FLASH", "off")  # this path, not the flash kernel (tests/test_cpu_flash.py)
    # every layer's whole block, the last one's too (a prefill's kept position alone: tests/test_kept_positions.py)
    monkeypatch.setattr(chunked_attention, "kept_queries", lambda module, queries: 0)
    from torch.profiler import profile

    from harness.backends.chunked_attention import CHUNK, CHUNKED_SDPA, MIN_QUERIES

    monkeypatch.setattr(chunked_attention, "ONEDNN_MIN_QUERIES", 10 ** 9)  # SDPA's chunks, whatever the machine
    backend = request.getfixturevalue(name)
    model = backend.model
    assert any("chunks" in f for f in backend.fused), backend.fused  # recorded in results.json
    out = {}
    try:
        for impl in ("sdpa", CHUNKED_SDPA):
            model.set_attn_implementation(impl)
            with profile() as prof:
                out[impl] = _long_paths(backend, torch.Generator().manual_seed(5))
            calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
            layers = model.config.num_hidden_layers
            blocks = (800, 780, 900)
            assert calls == (layers * len(blocks) + layers if impl == "sdpa" else  # + the 150-token prefix
                             layers * sum(-(-q // CHUNK) for q in blocks) + layers), (impl, calls)
    finally:
        model.set_attn_implementation(CHUNKED_SDPA)
    assert min((800, 780, 900)) >= MIN_QUERIES
    for one, chunked in zip(out["sdpa"], out[CHUNKED_SDPA]):
        assert len({int(i) for i in one.argmax(-1)}) > 1 or one.shape[0] == 1  # the rows differ
        torch.testing.assert_close(chunked, one, rtol=1e-5, atol=1e-5)
        assert torch.equal(chunked.argmax(-1), one.argmax(-1))


@pytest.mark.parametrize("name", ["phi_backend", "llama_backend", "gpt2_backend"])
def test_long_blocks_attending_by_onednns_products_equal_one_sdpa_call(name, request, monkeypatch):
    """Where a machine's products take oneDNN (forced here), a float32 block of >= ONEDNN_MIN_QUERIES queries
    attends through them, per head and chunk, with no SDPA call: the same logits as one SDPA call to float32
    rounding on a padded prefill, a padded block and an extend; a block shorter than that stays on SDPA."""
    monkeypatch.setenv("ICR_CPU_FLASH", "off")  # this path, not the flash kernel (tests/test_cpu_flash.py)
    # every layer's whole block, the last one's too (a prefill's kept position alone: tests/test_kept_positions.py)
    monkeypatch.setattr(chunked_attention, "kept_queries", lambda module, queries: 0)
    from torch.profiler import profile

    from harness.backends.chunked_attention import CHUNKED_SDPA, ONEDNN_MIN_QUERIES

    monkeypatch.setattr(onednn_linear, "choice", lambda: onednn_linear.LinearKernel(1, "forced"))
    backend = request.getfixturevalue(name)
    model, out = backend.model, {}
    try:
        for impl in ("sdpa", CHUNKED_SDPA):
            model.set_attn_implementation(impl)
            with profile() as prof:
                out[impl] = _long_paths(backend, torch.Generator().manual_seed(5))
            calls = {e.key: e.count for e in prof.key_averages()}
            products = calls.get("mkldnn::_linear_pointwise", 0)
            # the unpadded 150-token prefill passes no mask (SDPA's causal flag), the three other blocks do
            assert calls.get("aten::scaled_dot_product_attention", 0) == model.config.num_hidden_layers * (
                1 if impl == CHUNKED_SDPA else 4)
            heads = model.config.num_attention_heads
            assert impl == "sdpa" or products >= 2 * heads * model.config.num_hidden_layers * 3
    finally:
        model.set_attn_implementation(CHUNKED_SDPA)
    for one, ours in zip(out["sdpa"], out[CHUNKED_SDPA]):
        assert len({int(i) for i in one.argmax(-1)}) > 1 or one.shape[0] == 1  # the rows differ
        assert not torch.equal(ours, one)  # other kernels ran, whose sums round apart over the layers
        torch.testing.assert_close(ours, one, rtol=1e-4, atol=1e-4)
        assert torch.equal(ours.argmax(-1), one.argmax(-1))
    query = torch.randn(1, 2, ONEDNN_MIN_QUERIES - 1, 8)
    mask = torch.zeros(1, 1, ONEDNN_MIN_QUERIES - 1, ONEDNN_MIN_QUERIES - 1)
    assert not chunked_attention._by_products(model, query, mask, {"scaling": 0.3})
    assert chunked_attention._by_products(model, torch.randn(1, 2, ONEDNN_MIN_QUERIES, 8), mask.new_zeros(
        1, 1, ONEDNN_MIN_QUERIES, ONEDNN_MIN_QUERIES), {"scaling": 0.3})
    assert not chunked_attention._by_products(model, torch.randn(1, 2, ONEDNN_MIN_QUERIES, 8), mask.new_zeros(
        1, 1, ONEDNN_MIN_QUERIES, ONEDNN_MIN_QUERIES), {"softcap": 30.0})  # anything that changes the scores


def test_onednns_attention_equals_sdpa_in_float64_with_padding_grouped_heads_and_cached_keys():
    """``onednn_attention`` itself, against SDPA in float64: two rows (one left-padded), 4 query heads over 2
    key heads, 600 queries after 40 cached keys, in chunks; as close to the float64 result as SDPA in float32."""
    import torch.nn.functional as F

    from harness.backends.additive_mask import additive_mask
    from harness.backends.chunked_attention import ONEDNN_CHUNK, onednn_attention

    g = torch.Generator().manual_seed(2)
    past, q = 40, 600
    query = torch.randn(2, 4, q, 16, generator=g)
    key, value = (torch.randn(2, 2, past + q, 16, generator=g) for _ in range(2))
    seen = torch.ones(2, past + q, dtype=torch.bool)
    seen[1, :25] = False  # the second row's left padding
    mask = additive_mask(seen.long(), q, torch.float32)  # the harness's own: [rows, 1, queries, keys]
    assert q > ONEDNN_CHUNK and not torch.equal(mask[0], mask[1])
    ours = onednn_attention(query, key, value, mask, 0.25)

    def sdpa(dtype):
        k, v = (x.repeat_interleave(2, dim=1).to(dtype) for x in (key, value))
        return F.scaled_dot_product_attention(query.to(dtype), k, v, attn_mask=mask.to(dtype), scale=0.25)

    exact, theirs = sdpa(torch.float64).transpose(1, 2), sdpa(torch.float32).transpose(1, 2)
    real = seen[:, past:]  # a padded query attends to nothing real: its output is not read
    assert exact[real].std() > 0.1
    errors = [float((x.double() - exact)[real].abs().max()) for x in (ours, theirs)]
    assert errors[0] < 4 * errors[1] + 1e-7, errors


def test_a_built_masks_spans_are_exactly_where_it_is_not_zero():
    """``BuiltMask.masked_spans`` against the mask itself: for rows with no pads, left pads, pads in the middle and
    a pad at the end, and chunks of queries at the start, middle and end, the spans cover exactly the columns
    where the chunk's rows of the mask are not zero (none more, none fewer)."""
    from harness.backends.additive_mask import BuiltMask

    keys, queries = 300, 200
    padding = torch.ones(4, keys, dtype=torch.long)
    padding[1, :30] = 0
    padding[2, 40:45] = 0
    padding[2, 120:121] = 0
    padding[3, -1] = 0
    mask = additive_mask(padding, queries, torch.float32)
    known = BuiltMask(mask, padding)
    assert known.describes(mask) and known.describes(mask[..., :250]) and not known.describes(mask.clone())
    seen_spans = set()
    for row in range(4):
        for start, end in ((0, 64), (64, 128), (100, 101), (150, 200)):
            for n in (keys - queries + end, keys):
                spans = known.masked_spans(row, start, end, n)
                covered = torch.zeros(n, dtype=torch.bool)
                for lo, hi in spans:
                    assert 0 <= lo < hi <= n and not covered[lo:hi].any()  # disjoint, inside the columns
                    covered[lo:hi] = True
                assert torch.equal(covered, (mask[row, 0, start:end, :n] != 0).any(0)), (row, start, end, n)
                seen_spans.add(tuple(spans))
    assert len(seen_spans) > 8  # the cases differ


@pytest.mark.parametrize("name", ["phi_backend", "llama_backend"])
def test_a_built_mask_is_added_where_it_is_not_zero_with_the_same_logits_to_the_bit(name, request, monkeypatch):
    """Where oneDNN's products attend (forced here), the mask the backend built reaches every layer as it was
    built (its ``BuiltMask`` describes it), is added only over its spans, and the logits of a padded prefill, a
    padded block and an extend are those of adding it over every score, to the bit."""
    monkeypatch.setenv("ICR_CPU_FLASH", "off")  # this path, not the flash kernel (tests/test_cpu_flash.py)
    from harness.backends import additive_mask as built

    monkeypatch.setattr(onednn_linear, "choice", lambda: onednn_linear.LinearKernel(1, "forced"))
    backend = request.getfixturevalue(name)
    described = []
    real = built.BuiltMask.masked_spans

    def spans(self, row, start, end, keys):
        out = real(self, row, start, end, keys)
        described.append(sum(hi - lo for lo, hi in out) / keys)  # the share of the scores the mask is added to
        return out

    monkeypatch.setattr(built.BuiltMask, "masked_spans", spans)
    ours = _long_paths(backend, torch.Generator().manual_seed(8))
    assert len(described) >= 3 * backend.model.config.num_hidden_layers and min(described) < 0.5
    monkeypatch.setattr(built.BuiltMask, "describes", lambda self, mask: False)
    whole = _long_paths(backend, torch.Generator().manual_seed(8))
    for a, b in zip(ours, whole):
        assert b.shape[0] == 1 or (b[0] - b[-1]).abs().max() > 1e-3  # the rows differ
        assert torch.equal(a, b)


@pytest.mark.parametrize("queries, kv_heads", [(1, 4), (3, 4), (1, 2), (3, 2)])
def test_attention_over_a_shared_front_read_once_equals_sdpa_in_float64(queries, kv_heads):
    """``front_once_attention`` against SDPA in float64: five rows whose first 200 keys are the same, each
    padded after them to the longest rest, a step of 1 or 3 queries (causal among them), 4 query heads over 4 or
    2 key heads; as close to the float64 result as SDPA in float32."""
    import torch.nn.functional as F

    from harness.backends.chunked_attention import front_once_attention

    g = torch.Generator().manual_seed(3)
    rows, heads, d, shared, rests = 5, 4, 16, 200, [30, 90, 57, 120, 3]
    kv = shared + max(rests) + queries
    key, value = (torch.randn(rows, kv_heads, kv, d, generator=g) for _ in range(2))
    key[:, :, :shared], value[:, :, :shared] = key[:1, :, :shared], value[:1, :, :shared]
    query = torch.randn(rows, heads, queries, d, generator=g)
    mask = torch.zeros(rows, 1, queries, kv)
    low = torch.finfo(torch.float32).min
    for i, rest in enumerate(rests):
        mask[i, :, :, shared:shared + max(rests) - rest] = low  # the pads after the front
    for t in range(queries):
        mask[:, :, t, kv - queries + t + 1:] = low
    ours = front_once_attention(query, key, value, mask, shared, 0.25)

    def sdpa(dtype):
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1).to(dtype) for x in (key, value))
        return F.scaled_dot_product_attention(query.to(dtype), k, v, attn_mask=mask.to(dtype),
                                              scale=0.25).transpose(1, 2)

    exact, theirs = sdpa(torch.float64), sdpa(torch.float32)
    assert exact.std() > 0.05 and not torch.allclose(exact[0], exact[-1], atol=1e-3)
    errors = [float((x.double() - exact).abs().max()) for x in (ours, theirs)]
    assert errors[0] < 4 * errors[1] + 1e-7, errors
