"""The vLLM backend's logic on CPU: the shared state machine over a fake engine that implements vLLM's
continuation contract independently. It must give exactly what the stepped loop gives."""
import pytest

from harness.backends.base import GenRequest
from tests.helpers import assert_varied, diverse_prompts, fake_vllm_backend, mixed_requests


@pytest.mark.slow
@pytest.mark.parametrize("report_eos", [True, False])
@pytest.mark.parametrize("which", ["phi", "llama"])
def test_vllm_logic_equals_the_stepped_loop(which, report_eos, request):
    backend = request.getfixturevalue(f"{which}_backend")
    prompts = diverse_prompts(24, seed=31)
    free = backend.generate([GenRequest(p, 32) for p in prompts])
    stepped = backend.generate(mixed_requests(backend, prompts, free))
    vllm = fake_vllm_backend(backend, report_eos)
    chunked = vllm.generate(mixed_requests(backend, prompts, free))
    assert_varied([r.text for r in stepped])
    for a, b in zip(stepped, chunked):
        assert (a.text, a.finish_reason, a.stop_string, a.new_tokens, a.tool_tokens, a.token_ids, a.tool_spans,
                a.retokenized_spans) == \
               (b.text, b.finish_reason, b.stop_string, b.new_tokens, b.tool_tokens, b.token_ids, b.tool_spans,
                b.retokenized_spans)
    reasons = {r.finish_reason for r in stepped}
    assert {"stop", "length"} <= reasons, reasons  # stop strings and the limit were exercised
    assert sum(len(r.tool_spans) for r in stepped) >= 3 and any(r.retokenized_spans for r in stepped)
    assert vllm.engine.runs > len(prompts)  # tool calls ended runs that were resubmitted


def test_vllm_logic_respects_the_context_limit(phi_backend):
    vllm = fake_vllm_backend(phi_backend)
    prompt = diverse_prompts(1, seed=3)[0]
    n = len(phi_backend.tokenizer(prompt)["input_ids"])
    vllm.max_context = n + 5
    (r,) = vllm.generate([GenRequest(prompt, 20)])
    assert r.finish_reason in ("context", "eos") and r.prompt_tokens + len(r.token_ids) <= n + 5


@pytest.mark.parametrize("report_eos", [True, False])
def test_vllm_logic_ends_at_eos_like_the_stepped_loop(phi_backend, report_eos):
    prompts = diverse_prompts(24, seed=31)
    free = phi_backend.generate([GenRequest(p, 32) for p in prompts])
    eos = [p for p, f in zip(prompts, free) if f.finish_reason == "eos"]
    assert eos, "no prompt ends in EOS: pick other seeds"
    chunked = fake_vllm_backend(phi_backend, report_eos).generate([GenRequest(p, 32) for p in eos])
    stepped = [f for f in free if f.finish_reason == "eos"]
    assert [(r.text, r.finish_reason, r.token_ids) for r in chunked] == \
        [(r.text, r.finish_reason, r.token_ids) for r in stepped]


def test_engine_booleans_read_json_and_words_and_refuse_the_rest():
    """``enable_prefix_caching=off`` was the string "off", which is true."""
    import dataclasses

    from harness.backends.vllm_backend import VLLMError, check_engine_types, parse_engine_args

    got = parse_engine_args(["enable_prefix_caching=off", "enforce_eager=TRUE", "in_process=no", "a=yes",
                             "max_model_len=4096", "name=phi", "b=false"])
    assert got == {"enable_prefix_caching": False, "enforce_eager": True, "in_process": False, "a": True,
                   "max_model_len": 4096, "name": "phi", "b": False}

    @dataclasses.dataclass
    class Args:  # fields typed as vLLM's EngineArgs types them
        enforce_eager: bool = False
        enable_prefix_caching: bool | None = None
        hf_token: bool | str | None = None
        max_model_len: int | None = None

    fields = dataclasses.fields(Args)
    check_engine_types({"enforce_eager": True, "enable_prefix_caching": None, "hf_token": "abc", "max_model_len": 8},
                       fields)
    with pytest.raises(VLLMError, match="enforce_eager=.maybe.: vLLM's enforce_eager is true or false"):
        check_engine_types(parse_engine_args(["enforce_eager=maybe"]), fields)
    with pytest.raises(VLLMError, match="enable_prefix_caching"):
        check_engine_types(parse_engine_args(["enable_prefix_caching=sometimes"]), fields)
