"""Throughput on the 4-shot HotpotQA prompts: this harness vs per-sample ``transformers.generate`` vs
lm-evaluation-harness (``--model hf``), same tiny model, same prompts, outputs checked identical.

    python benchmarks/throughput.py [--questions 24] [--positions first,middle,last] [--hidden 64 --layers 2]
    pip install lm-eval   # for the lm-eval column (skipped, and said so, when it is not installed)

Also prints the prefill tokens this harness computes with and without shared-prefix reuse. Every number
comes from one run on one machine; model loading is excluded from every timing, and lm-eval's rows time its
model's ``generate_until`` alone (lm-eval's task indexing and set-up, several seconds, excluded)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from evals.hotpotqa import HotpotQA, load_rows, parse_positions
from harness.backends.generation import GenRequest, common_prefix, first_stop
from harness.engine import load_backend
from harness.engine.prompting import PromptTemplate
from harness.engine.run import plan_batches
from harness.tiny import make_tiny_model

STOP = HotpotQA.stop


def cut(text: str) -> str:
    hit = first_stop(text, STOP)
    return text[: hit[0]] if hit else text


def run_harness(backend, prompts, max_new, reuse: bool):
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    shared = common_prefix(ids) if reuse else None
    batches = plan_batches([len(i) for i in ids], "auto", backend.token_budget(), max_new)
    backend.stats = {}
    out = [None] * len(prompts)
    t0 = time.perf_counter()
    for b in batches:
        res = backend.generate([GenRequest(prompts[i], max_new, STOP, prompt_ids=ids[i]) for i in b], shared_prefix=shared)
        for i, r in zip(b, res):
            out[i] = r.text
    return out, time.perf_counter() - t0, dict(backend.stats), len(batches)


def run_generate(model, tok, prompts, max_new):
    out = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            gen = model.generate(**enc, max_new_tokens=max_new, do_sample=False, stop_strings=STOP, tokenizer=tok,
                                 pad_token_id=tok.pad_token_id)
            # a run cut by the length limit inside a multi-byte character ends in U+FFFD, here and in the harness
            out.append(cut(tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)))
    return out, time.perf_counter() - t0


def run_lm_eval(model_dir, prompts, max_new, batch_size, model="hf", stop=STOP):
    """The prompts as an lm-eval generate_until task, through lm-eval's hf model or this harness's ``icr``."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        return None, None
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
        (Path(d) / "icr_bench.yaml").write_text(
            "task: icr_hotpotqa_bench\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\noutput_type: generate_until\n"
            'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
            f"generation_kwargs:\n  until: {json.dumps(list(stop))}\n  max_gen_toks: {max_new}\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n")
        if model == "icr":
            import harness.lm_eval

            lm = harness.lm_eval.ICRLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch_size)
        else:
            from lm_eval.models.huggingface import HFLM

            lm = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch_size)
        spent = [0.0]  # seconds inside the model's generate_until: lm-eval's task indexing and set-up excluded
        generate = lm.generate_until

        def timed(requests, *args, **kwargs):
            t = time.perf_counter()
            try:
                return generate(requests, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        lm.generate_until = timed
        res = lm_eval.simple_evaluate(model=lm, tasks=["icr_hotpotqa_bench"], task_manager=TaskManager(include_path=d),
                                      log_samples=True, bootstrap_iters=0, verbosity="ERROR")
        elapsed = spent[0]
    samples = sorted(res["samples"]["icr_hotpotqa_bench"], key=lambda s: s["doc_id"])
    return [s["resps"][0][0] for s in samples], elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--positions", default="first,middle,last")
    ap.add_argument("--distractors", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lm-eval-batch-size", default="1", help="lm-eval's 'auto' picks 1 for generation")
    ap.add_argument("--icr-batch-size", default="8", help="batch size of lm-eval's icr model (this harness inside it)")
    a = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = load_rows("fixture")[: a.questions]
    task = HotpotQA(distractors=a.distractors, positions=parse_positions(a.positions))
    inst = task.instances(rows, seed=1234)
    tpl = PromptTemplate("hotpotqa_cot")
    prompts = [tpl.render(**task.template_vars(i)) for i in inst]
    with tempfile.TemporaryDirectory() as d:
        model_dir = str(make_tiny_model(Path(d) / "m", "phi", hidden=a.hidden, layers=a.layers))
        backend = load_backend(model_dir, "cpu", "float32")
        n_tok = [len(backend.tokenizer(p)["input_ids"]) for p in prompts]
        print(f"{len(prompts)} prompts (4-shot, {a.distractors} distractors), {min(n_tok)}-{max(n_tok)} tokens, "
              f"max {a.max_new_tokens} new; random Phi d={a.hidden} L={a.layers}, CPU, {torch.get_num_threads()} threads\n")
        run_harness(backend, prompts[:2], 4, True)  # warm-up
        ours, t_ours, st_reuse, nb = run_harness(backend, prompts, a.max_new_tokens, True)
        ours_np, t_np, st_plain, _ = run_harness(backend, prompts, a.max_new_tokens, False)
        gen, t_gen = run_generate(backend.model, backend.tokenizer, prompts, a.max_new_tokens)
        lme, t_lme = run_lm_eval(model_dir, prompts, a.max_new_tokens, a.lm_eval_batch_size)
        lmi, t_lmi = run_lm_eval(model_dir, prompts, a.max_new_tokens, a.icr_batch_size, model="icr")
    n = len(prompts)
    print(f"{'system':44s} {'seconds':>8s} {'samples/s':>10s} {'vs harness':>11s} identical")
    print(f"{'icr-harness (auto batches, prefix reuse)':44s} {t_ours:8.2f} {n / t_ours:10.2f} {'1.00x':>11s} -")
    print(f"{'icr-harness (auto batches, no reuse)':44s} {t_np:8.2f} {n / t_np:10.2f} {t_np / t_ours:10.2f}x "
          f"{ours_np == ours}")
    print(f"{'transformers.generate, one sample at a time':44s} {t_gen:8.2f} {n / t_gen:10.2f} {t_gen / t_ours:10.2f}x "
          f"{gen == ours}")
    if lme is None:
        print("lm-eval: not installed (pip install lm-eval) - column skipped")
    else:
        print(f"{'lm-eval hf, batch_size ' + a.lm_eval_batch_size:44s} {t_lme:8.2f} {n / t_lme:10.2f} "
              f"{t_lme / t_ours:10.2f}x {lme == ours}")
        if lme != ours:
            diff = sum(x != y for x, y in zip(lme, ours))
            print(f"  lm-eval differs on {diff}/{n} samples")
        print(f"{'lm-eval icr (this harness), batch_size ' + a.icr_batch_size:44s} {t_lmi:8.2f} {n / t_lmi:10.2f} "
              f"{t_lmi / t_ours:10.2f}x {lmi == ours}")
        print(f"  inside lm-eval, icr vs hf: {t_lme / t_lmi:.2f}x the samples/s, same outputs: {lmi == lme}")
    print(f"\nharness batches: {nb}; prefill tokens computed: {st_plain['prefill_tokens']} without reuse, "
          f"{st_reuse['prefill_tokens'] + st_reuse.get('prefix_tokens', 0)} with reuse "
          f"({st_plain['prefill_tokens'] / (st_reuse['prefill_tokens'] + st_reuse.get('prefix_tokens', 0)):.2f}x fewer)")


if __name__ == "__main__":
    main()
