"""``--audit N``: a run certifies itself. N of its rows, drawn at random (seeded), are generated again the
slowest, simplest way the backend has (one prompt alone, so no padding; no prefix reuse; no CUDA graphs; float32)
and compared with what the run wrote. On a CPU in float32 they agree; on a GPU this is how a user learns whether
bf16, kernels or graph buckets moved the numbers."""
from __future__ import annotations

import logging
import random
from typing import Any, Callable

from harness.backends.generation import GenRequest
from harness.backends.loading import load_backend
from harness.backends.vllm_backend import parse_engine_args

log = logging.getLogger("harness")


def reference_backend(cfg, backend):
    """The run's backend where it already is the reference (float32, no CUDA graphs); else a float32 copy."""
    if backend is not None and _dtype(backend) == "float32" and getattr(backend, "graphs", None) is None:
        return backend
    return load_backend(cfg.model, cfg.device, "float32", cfg.backend, cfg.tokenizer, cuda_graphs="off",
                        engine_args=parse_engine_args(getattr(cfg, "vllm_arg", None)))


def _dtype(backend) -> str:
    return str(backend.describe().get("dtype", "")).replace("torch.", "")


def audit_rows(cfg, backend, records: list[dict], request: Callable[[str], GenRequest], n: int) -> dict[str, Any]:
    """Regenerate ``n`` of ``records`` (scored rows only; ``request``: a row's key to what the run asked of the
    backend for it) with the reference path; how many agree, and where the first that does not parts from it."""
    scored = [r for r in records if not r.get("skipped")]
    chosen = random.Random(f"audit:{cfg.seed}").sample(scored, min(n, len(scored)))
    ref = reference_backend(cfg, backend)
    differ = []
    for rec in chosen:
        (out,) = ref.generate([request(rec["key"])])  # alone: no padding, no shared prefix
        if (out.text, out.finish_reason) != (rec["generation"], rec["finish_reason"]):
            differ.append({"key": rec["key"], **first_difference(ref.tokenizer, rec["generation"], out.text),
                           "run": rec["generation"][:300], "reference": out.text[:300]})
    result = {"rows": len(chosen), "agree": len(chosen) - len(differ), "differ": differ[:20],
              "reference": {"batch": 1, "prefix_reuse": "none", "cuda_graphs": False, "dtype": _dtype(ref)}}
    log.info("audit: %d of %d rows generated again alone, unpadded, in float32 agree%s", result["agree"],
             result["rows"], f" (first difference in {differ[0]['key']} at token {differ[0]['token']})"
             if differ else "")
    return result


def first_difference(tokenizer, a: str, b: str) -> dict[str, int]:
    """The character and the (generated) token at which two generations part."""
    char = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    ta = tokenizer(a, add_special_tokens=False)["input_ids"]
    tb = tokenizer(b, add_special_tokens=False)["input_ids"]
    token = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    return {"char": char, "token": token}
