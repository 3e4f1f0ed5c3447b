"""The shared greedy loop against ground truth computed without it: full forward passes, no cache."""
import random

import pytest
import torch

from evals.fixture import FIXTURE_PATH
from harness.backends.base import GenRequest
from tests.helpers import assert_varied, diverse_prompts, reference_greedy


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_batched_cached_greedy_equals_uncached_reference(which, request):
    backend = request.getfixturevalue(f"{which}_backend")
    prompts = diverse_prompts(6, seed=1)
    res = backend.generate([GenRequest(p, 10) for p in prompts])
    with torch.inference_mode():
        for p, r in zip(prompts, res):
            assert r.token_ids == reference_greedy(backend, p, 10)


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_batch_size_invariance_on_varied_lengths(which, request):
    backend = request.getfixturevalue(f"{which}_backend")
    prompts = diverse_prompts(16)
    reqs = [GenRequest(p, 16) for p in prompts]
    results = {}
    for bs in (1, 4, 16):
        results[bs] = [r.text for i in range(0, 16, bs) for r in backend.generate(reqs[i:i + bs])]
    assert_varied(results[1])
    assert results[1] == results[4] == results[16]


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_left_padded_batch_logits_equal_each_prompt_alone(which, request):
    """Token equality can hide small padding leaks (argmax is robust to them); the logits cannot."""
    from harness.backends.generation import left_pad

    backend = request.getfixturevalue(f"{which}_backend")
    seqs = [backend.tokenizer(p)["input_ids"] for p in diverse_prompts(6, seed=7)]
    with torch.inference_mode():
        ids, mask = left_pad(seqs, backend.tokenizer.pad_token_id, "cpu")
        batch, _ = backend.prefill(ids, mask)
        alone = torch.cat([backend.prefill(*left_pad([s], 0, "cpu"))[0] for s in seqs])
    assert_varied([int(a) for a in alone.argmax(-1)], "next tokens")
    assert torch.allclose(batch, alone, atol=1e-4), (batch - alone).abs().max()


def test_stop_strings_eos_and_length(phi_backend):
    all_prompts = diverse_prompts(8, seed=3)
    all_free = phi_backend.generate([GenRequest(p, 20) for p in all_prompts])
    assert all((r.finish_reason == "length" and r.new_tokens == 20) or (r.finish_reason == "eos" and r.new_tokens < 20)
               for r in all_free)
    kept = [(p, r) for p, r in zip(all_prompts, all_free) if r.finish_reason == "length"]  # a random model may EOS
    assert len(kept) >= 2
    prompts, free = [p for p, _ in kept], [r for _, r in kept]
    # stop at a string the unconstrained run produced: the text is cut right before it
    target = free[0].text[5:8]
    stopped = phi_backend.generate([GenRequest(prompts[0], 20, stop=[target])])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[0].text[: free[0].text.find(target)]
    zero = phi_backend.generate([GenRequest(prompts[1], 0)])[0]
    assert zero.text == "" and zero.new_tokens == 0


def test_incremental_detokenizer_equals_full_decode(tiny_tokenizer):
    from evals.istree import build_tokenizer
    from harness.backends.generation import IncrementalDetokenizer

    rng = random.Random(0)
    cut_mid_character = 0
    text = FIXTURE_PATH.read_text() + " naïve café — 東京 ✓ "
    for tok in (tiny_tokenizer, build_tokenizer(8)):
        for _ in range(50):
            if tok is tiny_tokenizer:
                ids = tok(text[rng.randrange(0, 500):][:300])["input_ids"]
                ids += [rng.randrange(len(tok)) for _ in range(20)]  # arbitrary tokens, partial UTF-8 included
            else:
                ids = [rng.randrange(len(tok)) for _ in range(40)]
            d = IncrementalDetokenizer(tok)
            for k in range(1, len(ids) + 1):
                d.update(ids[:k])
            full = tok.decode(ids, skip_special_tokens=False)
            assert d.text == full or (full.endswith("\ufffd") and full.startswith(d.text))
            held_back = d.text != full
            assert d.flush(ids) == full  # once generation ends, nothing is held back
            cut_mid_character += held_back
    assert cut_mid_character > 0, "some runs must end inside a character for flush to be tested"


def test_joined_masks_cut_columns_no_row_sees_and_right_align_every_row():
    from harness.backends.generation import join_masks

    running = torch.tensor([[0, 0, 0, 1, 1, 0, 1],  # the rows left: their first two columns masked in both
                            [0, 0, 1, 1, 1, 1, 1]])
    new = torch.tensor([[1, 1, 1], [0, 1, 1]])
    mask, cuts = join_masks([running, new])
    assert cuts == [(7, 2, 0), (3, 0, 2)]  # (width, cut, pad): 5 columns kept, the new batch padded to 5
    assert mask.tolist() == [[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert join_masks([new, running])[1] == [(3, 0, 2), (7, 2, 0)]  # order kept
    same, none_cut = join_masks([new, new])
    assert none_cut == [(3, 0, 0), (3, 0, 0)] and same.tolist() == new.tolist() * 2
