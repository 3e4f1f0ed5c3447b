"""The transformers families' graphed decode (harness.backends.kv_decode_graphs) with capture off: the same
static buffers, write index and additive mask a CUDA graph replays, run eagerly on CPU. Greedy output must be
the eager step's per family, at batch sizes that pad a row bucket, across capacity buckets (prompts past 256
tokens), with tool results mid-decode (an eager block written into the resident cache) and with rows leaving
the batch (a select, copied in again); a resident cache must not be copied again."""
from __future__ import annotations

import warnings

import pytest
import torch

from harness.backends.kv_decode_graphs import GraphedKVDecode, unsupported
from tests.helpers import assert_varied
from tests.helpers import HEADER, QUESTIONS, EchoTool, result_fields

ARCHS = ("phi", "llama", "gpt2")


@pytest.fixture(scope="module", params=ARCHS)
def backend(request, tmp_path_factory, tiny_tokenizer):
    from harness.backends.loading import load_backend
    from harness.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp(f"graphs-{request.param}") / "ckpt", request.param,
                           tokenizer=tiny_tokenizer, init_std=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_backend(str(path), device="cpu", dtype="float32")


def _requests(tok, long: bool, tool_end=None, max_new=12):
    from harness.backends.base import GenRequest

    header = HEADER * (8 if long else 1)  # 8 copies: prompts past 256 tokens, so steps cross capacity buckets
    prompts = [f"{header}Question: {q}\nAnswer:" for q in QUESTIONS]
    return [GenRequest(p, max_new + 3 * i, (), EchoTool(tool_end, i) if tool_end else None,
                       prompt_ids=tok(p)["input_ids"]) for i, p in enumerate(prompts)]


def _generate(backend, graphs, reqs, batch, reuse="none"):
    backend.graphs = graphs
    try:
        return backend.generate(reqs, batch_size=batch, prefix_reuse=reuse)
    finally:
        backend.graphs = None


@pytest.mark.slow
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_graphed_decode_equals_eager(backend, long):
    tok = backend.tokenizer
    assert unsupported(backend.model, backend.family) is None
    eager = _generate(backend, None, _requests(tok, long), 6)
    assert_varied([r.text for r in eager], f"{backend.family.name} generations")
    # a tool whose call ends on a character the model writes often: results of different lengths mid-decode
    counts = {}
    for r in eager:
        for ch in set(r.text[:-2]):
            counts[ch] = counts.get(ch, 0) + 1
    tool_end = max(sorted(counts), key=counts.get)
    with_tool = _generate(backend, None, _requests(tok, long, tool_end), 6)
    assert sum(len(r.tool_spans) for r in with_tool) >= 2, "the tool must be called mid-generation"
    for batch in (1, 3, 6):  # 3 pads a bucket of 4 rows; rows finish at different lengths (selects)
        graphs = GraphedKVDecode(backend.model, capture=False)
        assert result_fields(_generate(backend, graphs, _requests(tok, long), batch)) == result_fields(eager), \
            f"{backend.family.name}: batch {batch}"
        assert result_fields(_generate(backend, graphs, _requests(tok, long, tool_end), batch)) == result_fields(with_tool), \
            f"{backend.family.name}: batch {batch}, tool calls"
        assert graphs.cache.graphs and graphs.disabled is None
        # decoding after a copied shared prefix and after the prefix tree's merged rows
        for reuse in ("batch", "tree-rows"):
            assert result_fields(_generate(backend, graphs, _requests(tok, long, tool_end), batch, reuse)) == \
                result_fields(with_tool), f"{backend.family.name}: batch {batch}, prefix reuse {reuse}"
        if long:  # the prompts' lengths cross 256: buffers grew into the next capacity bucket
            assert graphs.buffers.capacity > 256


@torch.inference_mode()
def test_a_resident_cache_is_not_copied_again_and_a_second_cache_keeps_its_own(backend):
    """Step after step a cache stays in the buffers (one copy in); a second cache taking them over leaves the
    first its own copy, so both decode on exactly as they would eagerly."""
    from harness.backends.generation import left_pad

    tok = backend.tokenizer
    prompts = [tok(f"{HEADER}Question: {q}\nAnswer:")["input_ids"] for q in QUESTIONS[:3]]
    ids, mask = left_pad(prompts, tok.eos_token_id, "cpu")

    def decode(graphs, states, steps=6):
        """Two caches of the same prompts, stepped alternately after the first has run alone for two steps."""
        out = {}
        for name in states:
            out[name] = []
        for t in range(steps):
            for name, (logits, state, m) in list(states.items()):
                if name == "second" and t < 2:
                    continue
                token = logits.argmax(-1, keepdim=True)
                out[name].append(token[:, 0].tolist())
                m = torch.cat([m, torch.ones_like(token)], dim=1)
                backend.graphs = graphs
                try:
                    logits = backend.step(state, token, m)
                finally:
                    backend.graphs = None
                states[name] = (logits, state, m)
        return out

    def fresh():
        return {name: (*backend.prefill(ids, mask), mask) for name in ("first", "second")}

    eager = decode(None, fresh())
    graphs = GraphedKVDecode(backend.model, capture=False)
    got = decode(graphs, fresh())
    assert got == eager
    assert len({x for step in eager["first"] for x in step}) > 1, "the tokens must vary to compare anything"
    assert eager["second"] == eager["first"][:4], "the same prompts decode the same tokens"
    # first alone for two steps (one copy in), then the two alternate: each switch copies the other in
    assert graphs.copies_in == 1 + 2 * (6 - 2) - 1


def test_families_the_graphs_do_not_cover_decode_eagerly(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from harness.backends.families import family_of
    from harness.tiny import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", "mamba", tokenizer=tiny_tokenizer))
    assert "keys and values" in unsupported(model, family_of(model))


@pytest.mark.slow
def test_sixteen_rows_attend_over_tighter_capacities_with_the_eager_tokens(backend):
    """From 16 rows a graph attends over less than its buffers' capacity (``attended_capacity``): the same
    tokens, and graphs of capacities the buffers exceed."""
    from harness.backends.base import GenRequest
    from harness.cuda_graphs import capacity_bucket

    tok = backend.tokenizer
    prompts = [f"{QUESTIONS[-1 - i % len(QUESTIONS)]} {i}\n{HEADER * (11 + i % 3)}Question: {QUESTIONS[i % len(QUESTIONS)]} "
               f"({i * 7})\nAnswer:" for i in range(10)]
    ids = [tok(p)["input_ids"] for p in prompts]
    longest = max(len(x) for x in ids)
    assert 640 < longest <= 698, longest  # decoding stays inside one bucket of 768 while attending over 704

    def reqs():
        return [GenRequest(p, 6, (), None, prompt_ids=x) for p, x in zip(prompts, ids)]

    eager = _generate(backend, None, reqs(), 10)
    assert_varied([r.text for r in eager], f"{backend.family.name} generations")
    graphs = GraphedKVDecode(backend.model, capture=False)
    assert result_fields(_generate(backend, graphs, reqs(), 10)) == result_fields(eager)
    assert graphs.buffers.capacity == capacity_bucket(longest + 6) == 768
    assert {capacity for rows, capacity in graphs.cache.graphs if rows == 16} == {704}
