"""vLLM backend (optional extra, CUDA only) for Transformer checkpoints, with the retrieval tool loop.

Install with ``pip install "icr-harness[vllm]"`` on a GPU machine, then ``--backend vllm``. Generation is
greedy (temperature 0). vLLM cannot take tokens injected mid-sequence, so a tool call ends a round: the
round stops at the call's closing tag, the result is appended to the token sequence, and the next round
submits prompt + everything so far; automatic prefix caching (on) makes that resubmission reuse the KV
blocks already computed, which is vLLM's form of "continue from the cache". Phi-Mamba stays on its own
backend (vLLM's prefix caching does nothing for Mamba-2 state)."""
from __future__ import annotations

import logging
from typing import Sequence

from harness.backends.base import Backend
from harness.generation import GenRequest, GenResult

log = logging.getLogger("harness")


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, path: str, tokenizer: str | None = None, device: str = "auto", dtype: str = "auto",
                 gpu_memory_utilization: float = 0.85, **_):
        try:
            from vllm import LLM
        except ImportError as e:
            raise OSError("the vllm backend needs vLLM and a CUDA GPU: pip install 'icr-harness[vllm]' "
                          "(or use --backend transformers, which runs everywhere)") from e
        if device not in ("auto", "cuda") and not str(device).startswith("cuda"):
            raise OSError(f"the vllm backend runs on CUDA only, not on --device {device}")
        self.llm = LLM(model=path, tokenizer=tokenizer or path, dtype=dtype if dtype != "auto" else "auto",
                       enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization, seed=0)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.stats: dict[str, int] = {}
        import torch

        self.device = torch.device("cuda")
        log.info("vllm: %s, max_model_len %d, prefix caching on", path, self.max_context)

    # vLLM owns batching and the KV cache: the stepper interface is not used.
    def prefill(self, input_ids, attention_mask):
        raise NotImplementedError("vLLM schedules its own prefill")

    def step(self, state, input_ids, attention_mask):
        raise NotImplementedError("vLLM schedules its own decoding")

    def select(self, state, keep):
        raise NotImplementedError

    def expand(self, state, n):
        raise NotImplementedError

    def token_budget(self) -> int:
        return 1 << 30  # vLLM's scheduler batches by itself: hand it everything

    def generate(self, requests: Sequence[GenRequest], shared_prefix=None) -> list[GenResult]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt_ids = [list(r.prompt_ids) if r.prompt_ids is not None else self.tokenizer(r.prompt)["input_ids"]
                      for r in requests]
        gen: list[list[int]] = [[] for _ in requests]
        spans: list[list[tuple[int, int]]] = [[] for _ in requests]
        texts = [""] * len(requests)
        new_tokens = [0] * len(requests)
        calls = [0] * len(requests)
        since = [0] * len(requests)  # where the model's text since its last tool result begins
        results: list[GenResult | None] = [None] * len(requests)
        active = list(range(len(requests)))
        while active:
            params, prompts = [], []
            for i in active:
                r = requests[i]
                tool_open = r.tool is not None and calls[i] < r.tool.max_calls
                stops = list(r.stop) + ([r.tool.call_end] if tool_open else [])
                params.append(SamplingParams(temperature=0.0, max_tokens=max(1, r.max_new_tokens - new_tokens[i]),
                                             stop=stops or None, include_stop_str_in_output=True))
                prompts.append(TokensPrompt(prompt_token_ids=prompt_ids[i] + gen[i]))
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            still = []
            for i, out in zip(active, outs):
                r, o = requests[i], out.outputs[0]
                gen[i] += list(o.token_ids)
                new_tokens[i] += len(o.token_ids)
                texts[i] += o.text
                reason = o.stop_reason
                if r.tool is not None and reason == r.tool.call_end:
                    result = r.tool(texts[i], since[i])
                    calls[i] += 1
                    ids = self.tokenizer(result, add_special_tokens=False)["input_ids"]
                    spans[i].append((len(gen[i]), len(gen[i]) + len(ids)))
                    gen[i] += ids
                    texts[i] += result
                    since[i] = len(texts[i])
                    if new_tokens[i] < r.max_new_tokens:
                        still.append(i)
                        continue
                finish = "stop" if isinstance(reason, str) else ("eos" if o.finish_reason == "stop" else "length")
                text = texts[i]
                if isinstance(reason, str) and reason in r.stop:
                    text = text[: text.rfind(reason)]
                results[i] = GenResult(text=text, finish_reason=finish, prompt_tokens=len(prompt_ids[i]),
                                       new_tokens=new_tokens[i], tool_tokens=sum(b - a for a, b in spans[i]),
                                       token_ids=gen[i], tool_spans=spans[i])
            active = still
        return results

    def describe(self):
        return {"backend": self.name, "device": "cuda", "max_context": self.max_context, "prefix_caching": True}
