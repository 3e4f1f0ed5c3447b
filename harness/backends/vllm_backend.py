"""vLLM backend (optional extra, CUDA only) for Transformer checkpoints, with the retrieval tool loop.

Install with ``pip install "icr-harness[vllm]"`` on a GPU machine, then ``--backend vllm``. Generation is
greedy (temperature 0). vLLM cannot take tokens injected mid-sequence, so a tool call ends a round: the
round stops at the call's closing tag, the result is appended to the token sequence, and the next round
submits prompt + everything so far (stops, limits and tool calls are decided by the same state machine as
every other backend: ``harness.backends.generation.chunked_generate``); automatic prefix caching (on) makes that resubmission reuse the KV
blocks already computed, which is vLLM's form of "continue from the cache". Phi-Mamba stays on its own
backend (vLLM's prefix caching does nothing for Mamba-2 state)."""
from __future__ import annotations

import logging
from typing import Sequence

from harness.backends.base import Backend, Generation
from harness.backends.generation import GenRequest, chunked_generate

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

    def generate_all(self, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                     prefix_reuse: str = "auto", prefix_memory: str | int = "auto") -> Generation:
        """Every request handed to vLLM at once (its scheduler batches, its prefix cache reuses the shared
        few-shot prefix and everything resubmitted after a tool call), through the shared state machine
        (``chunked_generate``); ``batch_size`` and ``prefix_reuse`` are vLLM's to decide."""
        info = {"prefix_reuse": "vllm prefix caching", "prefix_reuse_asked": prefix_reuse,
                "plan_reason": "vLLM schedules its own batches and caches shared prefixes in blocks"}

        def everything():
            if requests:
                yield list(range(len(requests))), chunked_generate(self.continue_rows, self.tokenizer, requests,
                                                                   max_context=self.max_context)

        return Generation(info, everything())

    def continue_rows(self, seqs: list[list[int]], max_tokens: list[int], stops: list[list[str]]) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=0.0, max_tokens=max(1, m), stop=s or None,
                                 include_stop_str_in_output=True) for m, s in zip(max_tokens, stops)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=q) for q in seqs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def describe(self):
        return {"backend": self.name, "device": "cuda", "max_context": self.max_context, "prefix_caching": True}

