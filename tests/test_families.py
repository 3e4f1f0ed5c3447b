"""The family matrix: for every model family in harness/backends/families.py, greedy output at batch 4 equals
batch 1, equals decoding without prefix reuse and through the prefix tree, and equals an uncached per-sample reference that runs each
sequence alone through a full forward pass at every step (no cache, no padding). With and without tool calls
whose results differ in length per row (ragged blocks, the case that corrupts recurrent state)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from harness.backends.base import StepModel
from harness.backends.families import FAMILIES, family_of
from harness.backends.generation import greedy_generate
from harness.ops.kernels import interpreting
from harness.tiny import FAMILY_ARCHS, FLA_ARCHS
from tests.helpers import (
    HEADER,
    QUESTIONS,
    assert_varied,
    family_requests,
    generate_with,
    RecomputeReference,
    result_fields,
)

INIT_STD = {"lfm2": 0.1}  # large enough that each family's output depends on the whole prompt


def _fla_here() -> bool:
    """fla's families join the matrix where fla is installed and Triton interprets on CPU (tests/test_fla.py
    runs this file so in a child process)."""
    import importlib.util

    return interpreting() and importlib.util.find_spec("fla") is not None


@pytest.fixture(scope="module", params=("llama", *FAMILY_ARCHS, *(FLA_ARCHS if _fla_here() else ())))
def family_backend(request, tmp_path_factory, tiny_tokenizer):
    from harness.backends.loading import load_backend
    from harness.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp(f"family-{request.param}") / "ckpt", request.param, tokenizer=tiny_tokenizer,
                           init_std=INIT_STD.get(request.param, 0.2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_backend(str(path), device="cpu", dtype="float32")


@pytest.mark.slow
@pytest.mark.parametrize("with_tool", [False, True], ids=["plain", "tool"])
def test_greedy_output_is_independent_of_batching(family_backend, with_tool):
    b = family_backend
    tok = b.tokenizer
    plain_ref = [greedy_generate(RecomputeReference(b.model), tok, [r])[0] for r in family_requests(tok)]
    assert_varied([r.text for r in plain_ref], f"{b.family.name} generations")
    tool_end = _often_written(plain_ref) if with_tool else None
    reqs = family_requests(tok, tool_end)
    ref = [greedy_generate(RecomputeReference(b.model), tok, [r])[0] for r in reqs]
    if with_tool:
        lengths = {e - s for r in ref for s, e in r.tool_spans}
        assert len(lengths) > 1, "the tool results must differ in length to make ragged blocks"
    for batch, reuse, batching in [(4, "batch", "continuous"), (1, "batch", "auto"), (4, "none", "continuous"),
                                   (4, "none", "static"), (6, "batch", "auto"), (4, "tree-rows", "continuous"),
                                   (4, "tree-block", "continuous")]:  # 6 prompts: at batch 4, rows refilled
        got = generate_with(b, family_requests(tok, tool_end), batch, reuse, batching)
        assert result_fields(got) == result_fields(ref), \
            f"{b.family.name}: batch {batch}, prefix reuse {reuse}, batching {batching}"


@pytest.mark.slow
def test_rows_that_join_a_running_batch_write_what_static_batches_write(family_backend):
    """Continuous batching: as rows finish, the next prompts are prefilled and joined to the running batch (its
    mask's fully masked leading columns cut, both sides left-padded to one width). Rows of several lengths (their
    budgets differ) and tool results of several lengths, so joins meet rows mid-decode and ragged blocks; each
    row's output is the static batches' and the one-at-a-time run's."""
    b = family_backend
    if not b.batches_exact():
        pytest.skip(f"{b.family.name} runs each sample alone")
    tok = b.tokenizer
    tool_end = _often_written([greedy_generate(b, tok, [r])[0] for r in family_requests(tok)])

    def requests():
        return [dataclasses.replace(r, max_new_tokens=3 + 4 * (i % 4)) for i, r in
                enumerate(family_requests(tok, tool_end) + family_requests(tok)[::-1])]

    seen = []
    join = b.join
    b.join = lambda states, cuts: seen.append(list(cuts)) or join(states, cuts)  # the real join, its cuts kept
    try:
        runs = {(batch, how): b.generate_all(requests(), batch_size=batch, prefix_reuse="none", batching=how)
                for batch, how in ((3, "continuous"), (3, "static"), (1, "static"))}
        results = {k: g.results(len(requests())) for k, g in runs.items()}
    finally:
        del b.join
    assert runs[3, "continuous"].plan.batching == "continuous" and runs[3, "static"].plan.batching == "static"
    alone = results[1, "static"]
    assert_varied([r.text for r in alone], f"{b.family.name} generations")
    assert len({r.new_tokens for r in alone}) > 2 and any(r.tool_spans for r in alone)
    assert result_fields(results[3, "continuous"]) == result_fields(results[3, "static"]) == result_fields(alone)
    assert seen and any(cut > 0 for cuts in seen for _, cut, _ in cuts), "joins that cut finished rows' columns"
    assert any(pad > 0 for cuts in seen for _, _, pad in cuts), "joins that pad the narrower batch"


def _often_written(results) -> str:
    """A character the model really writes in most rows: as a call's closing tag, the tool is called mid-generation
    in several rows."""
    counts = {}
    for r in results:
        for ch in set(r.text[:-2]):
            counts[ch] = counts.get(ch, 0) + 1
    return max(sorted(counts), key=counts.get)


class _BlocksWhole(StepModel):
    """The backend, with the decode loop told it takes every block in one call: rows' tool results then arrive as
    ragged blocks the backend splits itself (a call per token, finished rows' state put back)."""

    def __init__(self, backend):
        self.b, self.name, self.tokenizer, self.device = backend, "blocks whole", backend.tokenizer, backend.device

    def prefill(self, input_ids, attention_mask):
        return self.b.prefill(input_ids, attention_mask)

    def step(self, state, input_ids, attention_mask):
        return self.b.step(state, input_ids, attention_mask)

    def select(self, state, keep):
        return self.b.select(state, keep)

    def expand(self, state, n):
        return self.b.expand(state, n)


@pytest.mark.slow
def test_a_recurrent_family_is_fed_tool_results_one_token_a_step(family_backend):
    """A batched family that does not mask padding would feed a step's ragged blocks (tool results of several
    lengths) a call per token, the other rows idle: the loop feeds every row one token a step instead, so a step
    is one call, and each row's tokens and output are those of the split blocks."""
    b = family_backend
    if not b.batches_exact() or not b.feeds_token_by_token([1, 2]):
        pytest.skip(f"{b.family.name}: {'runs each sample alone' if not b.batches_exact() else 'masks padding'}")
    tok = b.tokenizer
    tool_end = _often_written([greedy_generate(b, tok, [r])[0] for r in family_requests(tok)])
    calls = []
    hook = b.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        runs = {}
        for name, stepper in (("one token", b), ("blocks whole", _BlocksWhole(b))):
            calls.clear()
            stats = {}
            out = greedy_generate(stepper, tok, family_requests(tok, tool_end), stats=stats)
            runs[name] = (out, len(calls), stats["decode_steps"])
    finally:
        hook.remove()
    (one, one_calls, one_steps), (whole, whole_calls, whole_steps) = runs["one token"], runs["blocks whole"]
    assert_varied([r.text for r in one], f"{b.family.name} generations")
    assert len({e - s for r in one for s, e in r.tool_spans}) > 1 and max(
        e - s for r in one for s, e in r.tool_spans) > 1, "tool results of several lengths: ragged blocks"
    assert result_fields(one) == result_fields(whole)
    assert one_calls == 1 + one_steps  # the prefill, then one call a step
    assert whole_calls > 1 + whole_steps  # the blocks split inside steps
    assert one_calls < whole_calls


PADS = (1, 6, 17)  # left pads that are not a multiple of a Mamba-2 chunk (the tiny configs' is 16), and one that is
# Computed in float64 (another batch shape's rounding is then ~1e-15), returned as float32: exact families measure 0,
# the SSD families (Mamba-2, Bamba, Falcon-H1, float32 inside) <= 1e-6, Zamba2 1.1e-5. Jamba's experts take no
# float64: it is measured in float32, where the exact families measure <= 5e-6 (and Zamba2 3e-5).
PADDED_TOLERANCE = {"float64": 3e-6, "float32": 2e-5}
FLOAT32_ONLY = ("jamba",)


@torch.inference_mode()
def test_a_family_batched_with_left_pads_prefills_as_it_does_alone(family_backend):
    """What a family's padding mode promises, measured: a prompt several chunks long, left-padded by 1, 6 and 17
    tokens (ordinary tokens under a zero mask) beside an unpadded row, gives the last logits it gives alone (to float32 rounding). A family that does
    not is declared ``alone`` (Zamba2 moves by 1e-4 to 3e-3), so its greedy output never depends on its batch."""
    b = family_backend
    if b.family.padding == "alone":
        assert not b.batches_exact()
        return
    import copy

    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    model = b.model
    dtype = torch.float32 if b.family.name in FLOAT32_ONLY else torch.float64
    tolerance = PADDED_TOLERANCE[str(dtype).replace("torch.", "")]
    b.model = copy.deepcopy(model).to(dtype)
    try:
        for length in (40, 100):
            ids = torch.randint(5, len(b.tokenizer) - 1, (1, length), generator=gen)
            alone, _ = b.prefill(ids, torch.ones_like(ids))
            for pads in PADS:
                # the pads are ordinary tokens (a real checkpoint's pad embedding is not zero): the mask must hide them
                padded = torch.cat([torch.randint(5, len(b.tokenizer) - 1, (1, pads), generator=gen), ids], 1)
                mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones_like(ids)], 1)
                other = torch.randint(5, len(b.tokenizer) - 1, (1, length + pads), generator=gen)
                logits, _ = b.prefill(torch.cat([padded, other]), torch.cat([mask, torch.ones_like(other)]))
                worst = max(worst, (logits[0] - alone[0]).abs().max().item())
    finally:
        b.model = model
    spread = alone.std().item()
    assert spread > 1e4 * tolerance  # logits that vary: the comparison is not vacuous
    assert worst <= tolerance, (f"{b.family.name} is declared {b.family.padding!r}, but a left-padded prefill "
                                       f"moves its logits by {worst:.1e} ({dtype}): declare it 'alone' in "
                                       "harness/backends/families.py")


SEGMENT_CUTS = ([774, 775], [300, 301, 302, 1000], [1, 2], [517], [1599])  # one-token segments, arbitrary depths


@torch.inference_mode()
def test_the_tree_runs_only_where_segments_equal_a_whole_prefill(family_backend):
    """The prefix tree's premise at a sweep's length (1,600 tokens) and cuts (a one-token segment mid-prompt,
    cuts at arbitrary depths, a one-token last segment): where the planner may use the tree, a prompt fed in
    cached segments gives a whole prefill's logits; where a family is kept off it for its segments (Zamba2),
    they measurably differ, and a run asking for the tree falls back and says why."""
    b = family_backend
    n = 1600
    ids = torch.randint(5, len(b.tokenizer) - 1, (1, n), generator=torch.Generator().manual_seed(0))
    whole, _ = b.prefill(ids, torch.ones_like(ids))
    worst = 0.0
    for cuts in SEGMENT_CUTS:
        bounds = [0, *cuts, n]
        seg = ids[:, :bounds[1]]
        logits, state = b.prefill(seg, torch.ones_like(seg))
        for a, z in zip(bounds[1:], bounds[2:]):
            logits = b.extend(state, ids[0, a:z].tolist(), a)
        worst = max(worst, float((logits - whole).abs().max() / whole.abs().max()))
    if b.tree_unsupported() is None:
        assert worst < 1e-5, f"{b.family.name}: segments move the logits by {worst:.2e} of their scale"
    if not b.family.segments_exact:
        assert worst > 1e-5, f"{b.family.name}: segments now equal a whole prefill; let the tree run it"
        gen = b.generate_all(family_requests(b.tokenizer)[:3], prefix_reuse="tree")
        why = "runs each sample alone" if b.family.padding == "alone" else "segments"
        assert gen.plan.mode != "tree" and why in gen.plan.reason, gen.plan.reason


def test_every_listed_family_is_in_the_matrix():
    assert set(FAMILIES) - {"icr_hybrid"} <= set(FAMILY_ARCHS + FLA_ARCHS)


def test_unlisted_attention_model_is_inspected_as_masked(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.config.model_type = "some_new_attention_model"
    fam = family_of(model)
    assert fam.padding == "masked" and fam.copied_prefix_exact


def test_unlisted_recurrent_model_runs_alone(tmp_path, tiny_tokenizer, caplog):
    from transformers import AutoModelForCausalLM

    from harness.tiny import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", "lfm2", tokenizer=tiny_tokenizer))
    model.config.model_type = "some_new_hybrid"
    with caplog.at_level("WARNING", logger="harness"):
        fam = family_of(model)
    assert fam.padding == "alone" and not fam.copied_prefix_exact
    assert "families.py" in caplog.text


def _scoring_pairs(tok):
    """(context, continuation) token ids of different lengths, so a batch holds ragged rows."""
    pairs = []
    for i, q in enumerate(QUESTIONS):
        ctx = tok(f"{HEADER[: 40 * (i + 1)]}Question: {q}\nAnswer:")["input_ids"]
        pairs.append((ctx, tok(" " + "yes no maybe so"[: 3 + 2 * i])["input_ids"]))
    return pairs


@torch.no_grad()
def _alone_reference(forward, pairs):
    """Each row scored alone and unpadded, straight from the model's forward: the batched path's reference."""
    out = []
    for ctx, cont in pairs:
        ids = torch.tensor([ctx + cont[:-1]])
        logits = forward(ids)[0].float().log_softmax(-1)[len(ctx) - 1:]
        tgt = torch.tensor(cont)
        out.append((float(logits.gather(1, tgt[:, None]).sum()), bool((logits.argmax(-1) == tgt).all())))
    return out


def _choice_pairs(tok):
    """Multiple-choice rows: two contexts, each with choices of 1, 2 and 4 tokens, the greedy one among them."""
    pairs = []
    for q in QUESTIONS[:2]:
        ctx = tok(f"{HEADER}Question: {q}\nAnswer:")["input_ids"]
        pairs += [(ctx, tok(" " + c)["input_ids"]) for c in ("yes", "no no", "maybe so, maybe not")]
    return pairs


def _check_scores(backend, forward, name):
    pairs = _scoring_pairs(backend.tokenizer) + _choice_pairs(backend.tokenizer)
    ref = _alone_reference(forward, pairs)
    assert len({round(s, 6) for s, _ in ref}) == len(ref), "the scores must differ between rows"
    backend.stats = {}
    for batch in (1, 3, len(pairs)):
        got = backend.loglikelihood(pairs, batch)
        assert [g for _, g in got] == [g for _, g in ref], f"{name}: batch {batch}"
        assert max(abs(s - r) for (s, _), (r, _) in zip(got, ref)) < 1e-4, f"{name}: batch {batch}"
    # the choices were scored after one prefill of their shared context wherever that is exact
    shared = backend.stats.get("loglikelihood_shared_rows", 0)
    assert shared == (3 * 6 if backend.prefix_exact() else 0), f"{name}: {shared} rows after a shared prefill"


def test_loglikelihood_is_independent_of_batching(family_backend):
    _check_scores(family_backend, lambda ids: family_backend.model(input_ids=ids).logits, family_backend.family.name)


@pytest.mark.parametrize("which", ["phi_mamba_backend", "hybrid_backend"])
def test_phi_mamba_loglikelihood_is_independent_of_batching(which, request):
    b = request.getfixturevalue(which)
    _check_scores(b, lambda ids: b.model(ids)[0], which)
