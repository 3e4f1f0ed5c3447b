"""Throughput on the 4-shot HotpotQA prompts: the engine's default plan (``--prefix-reuse auto``) and each plan
forced, against per-sample ``transformers.generate`` and lm-evaluation-harness (``--model hf``, and this harness
inside it as ``icr``), same model, same prompts, outputs checked identical.

    python benchmarks/throughput.py [--questions 8] [--positions first,middle,last] [--hidden 256 --layers 6]
    pip install lm-eval   # for the lm-eval rows (skipped, and said so, when it is not installed)
    bash scripts/with-vllm-cpu.sh python benchmarks/throughput.py --backend vllm --plans auto --repeats 3
                                                                  # vLLM beside the default, prefill split out
    bash scripts/with-vllm-cpu.sh python benchmarks/throughput.py --backend vllm --arch hybrid-phi-mamba

``--arch phi-mamba`` / ``hybrid-phi-mamba`` time the paper's models (random weights, tiny shapes): vLLM runs them
through the project's plugin (harness/backends/vllm_plugin.py, prefix caching off: not exact for them), and the
baseline is the harness's own plan ``none`` (one sample at a time, nothing shared): transformers and lm-eval's
``hf`` model cannot load these checkpoints.

``--backend vllm`` adds vLLM, the engine a user would pick instead, on the same prompts: prefix caching on and
off, each in a child process (``VLLMChild``) with the same thread count as the harness and the same heap (freed
memory kept for reuse, ``cpu_heap``: without it vLLM's prefill faulted its activations in again each run in some
starts, 1.6x slower); engine start-up is reported apart from generation. The harness's default plan and vLLM
then run in turn, ``--repeats`` rounds each (medians compared, and round by round: this machine's speed drifts
by minutes, and runs in turn see the same drift), and with prefix caching on each one's prefill alone as often, so the line under the table says
where a difference lies: prompts or new tokens.
``transformers.generate`` runs the checkpoint as transformers loads it, so "identical" also checks what the
harness changes in the forward for speed (harness/backends/fused_activations.py).

On a CPU generation here is prefill-bound, so at transformers' cost per token no plan could beat per-sample
``generate`` by more than the prompt tokens over the prefix tree's distinct tokens (the "bound" printed); the
harness's own kernels (oneDNN's products, the CPU flash attention kernel) also make each token cheaper than
transformers' forward, so the default exceeds that bound, and the last line splits its speed into the two. Every number comes from one run on one machine; model loading is excluded from every timing
(the default plan reads its cost model as a later run on the machine does, from the cache folder; what a
machine's first run pays to measure it is printed apart), and lm-eval's rows time its model's
``generate_until`` alone (lm-eval's task indexing and set-up, several seconds, excluded)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median_high as median  # the upper middle: a run that was timed

import torch
from transformers import AutoModelForCausalLM

from evals.hotpotqa import HotpotQA, load_rows, parse_positions
from harness.backends import cpu_heap
from harness.backends.base import GenRequest
from harness.backends.generation import first_stop
from harness.backends.prefix_tree import PrefixTree
from harness.backends.loading import load_backend
from harness.backends.planner import forget_costs, time_costs
from harness.engine.prompting import PromptTemplate
from harness.tiny import make_tiny_model
from harness.tools.bench import benchmark_parser
from harness.tools.gpu_suite import NEAR_TIE

STOP = HotpotQA.stop


def cut(text: str) -> str:
    hit = first_stop(text, STOP)
    return text[: hit[0]] if hit else text


PLANS = ("auto", "tree-rows", "tree-block", "batch", "none")


def run_harness(backend, prompts, max_new, plan: str):
    """The engine's path: every request to ``generate_all`` with the batch size and plan a run would use."""
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    forget_costs(backend)  # auto reads its cost model inside the timing, as a fresh process on this machine does
    t0 = time.perf_counter()
    gen = backend.generate_all([GenRequest(p, max_new, STOP, prompt_ids=i) for p, i in zip(prompts, ids)],
                               batch_size="auto", prefix_reuse=plan)
    out = [r.text for r in gen.results(len(prompts))]
    return out, time.perf_counter() - t0, gen.plan


def cost_model_seconds(backend, plan) -> float | None:
    """The seconds ``auto``'s cost model takes to measure, at the plan ``plan``'s shape (median of three; None
    where the plan priced nothing): what a machine's first run with the model pays once, later runs reading it."""
    if not plan.costs:
        return None
    rows, length = plan.costs["measured_at"]
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        time_costs(backend, length, rows)
        took.append(time.perf_counter() - t0)
    return median(took)


def run_generate(model, tok, prompts, max_new):
    """Per-sample ``generate``: the texts, the seconds, and the new tokens (where another engine parts from them)."""
    out, ids = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            gen = model.generate(**enc, max_new_tokens=max_new, do_sample=False, stop_strings=STOP, tokenizer=tok,
                                 pad_token_id=tok.pad_token_id)
            # a run cut by the length limit inside a multi-byte character ends in U+FFFD, here and in the harness
            out.append(cut(tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)))
            ids.append(gen[0, enc["input_ids"].shape[1]:].tolist())
    return out, time.perf_counter() - t0, ids


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
            import harness.icr_lm

            lm = harness.icr_lm.ICRLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch_size)
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
        # only this task is indexed: lm-eval's own task index (thousands of YAML files) takes ~10 s to build
        tasks = TaskManager(include_path=d, include_defaults=False)
        res = lm_eval.simple_evaluate(model=lm, tasks=["icr_hotpotqa_bench"], task_manager=tasks, log_samples=True,
                                      bootstrap_iters=0, verbosity="ERROR")
        elapsed = spent[0]
    samples = sorted(res["samples"]["icr_hotpotqa_bench"], key=lambda s: s["doc_id"])
    return [s["resps"][0][0] for s in samples], elapsed


@torch.inference_mode()
def near_tie(backend, prompt: str, other: list[int]) -> tuple[int, float, float]:
    """Where ``other`` (another engine's greedy tokens) first parts from this model's greedy choice, the gap
    between this model's top two logits there, and its logits' spread (their standard deviation)."""
    ids = backend.tokenizer(prompt)["input_ids"]
    logits = backend.sequence_logits(torch.tensor([ids + other]))[0, len(ids) - 1:].double()
    for j, tok in enumerate(other):
        top = logits[j].topk(2)
        if int(top.indices[0]) != tok:
            return j, float(top.values[0] - top.values[1]), float(logits[j].std())
    return len(other), float("nan"), float("nan")


def explain_differences(backend, prompts, texts, reference, reference_ids, whose: str) -> None:
    """A line for each prompt whose text is not the reference's: where the reference's tokens part from this
    model's greedy choice and whether that is a near-tie (the top two logits within ``NEAR_TIE`` of their spread,
    as the GPU suite judges: float32 kernels that sum in another order can flip one; a masking bug moves a
    logit by the spread itself)."""
    for i, (ours, theirs) in enumerate(zip(texts, reference)):
        if ours != theirs:
            j, gap, spread = near_tie(backend, prompts[i], reference_ids[i])
            ratio = gap / spread
            kind = "a near-tie" if ratio <= NEAR_TIE["float32"] else "NOT a near-tie"
            print(f"  prompt {i} differs from {whose}'s token {j} on, where the harness's top two logits are "
                  f"{gap:.1e} apart, {ratio:.1e} of their spread: {kind} (<= {NEAR_TIE['float32']:g})")


class VLLMChild:
    """vLLM's engine in a child process (vLLM re-decorates transformers' model classes and sets its thread count
    in its process), driven one generation at a time over its stdin, so its runs can alternate with the
    harness's: on a machine whose speed drifts by minutes, runs timed in turn see the same drift. Each run
    empties vLLM's prefix cache first (a second run would otherwise find every prompt cached)."""

    CODE = """
import json, sys, time, torch
from harness.backends.base import GenRequest
from harness.backends.vllm_backend import VLLMBackend
model_dir, caching, prompts, stop = json.loads(sys.stdin.readline())
t0 = time.perf_counter()
engine = VLLMBackend(model_dir, device="cpu", dtype="float32", engine_args={"enable_prefix_caching": caching})
start = time.perf_counter() - t0
engine.generate([GenRequest("A warm-up prompt that shares nothing.", 4, stop)])
print("READY " + json.dumps({"start_s": start, "threads": torch.get_num_threads(), "vllm": engine.settings["vllm"],
                            "heap": engine.describe().extra.get("heap")}),
      flush=True)
last = {}
for line in sys.stdin:
    new = int(line)
    engine.llm.reset_prefix_cache()
    t0 = time.perf_counter()
    last[new] = engine.generate_all([GenRequest(p, new, stop) for p in prompts]).results(len(prompts))
    print(f"TIME {time.perf_counter() - t0}", flush=True)
print("RESULT " + json.dumps({n: [[r.text for r in rs], [r.token_ids for r in rs]] for n, rs in last.items()}),
      flush=True)
"""

    def __init__(self, model_dir: str, prompts: list[str], caching: bool):
        self.caching, self.log = caching, tempfile.TemporaryFile("w+")
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        self.proc.stdin.write(json.dumps([model_dir, caching, prompts, list(STOP)]) + "\n")
        self.proc.stdin.flush()
        self.info = json.loads(self._reply("READY "))
        self.times: dict[int, list[float]] = {}

    def _reply(self, tag: str) -> str:
        for line in self.proc.stdout:  # vLLM may print lines of its own
            if line.startswith(tag):
                return line[len(tag):]
        self.log.seek(0)
        raise SystemExit(f"vLLM run failed:\n{self.log.read()[-3000:]}")

    def run(self, new: int) -> float:
        self.proc.stdin.write(f"{new}\n")
        self.proc.stdin.flush()
        t = float(self._reply("TIME "))
        self.times.setdefault(new, []).append(t)
        return t

    def close(self, new: int) -> dict:
        """Its settings, its runs' times and the last run's texts and tokens with ``new`` tokens a prompt."""
        self.proc.stdin.close()
        last = json.loads(self._reply("RESULT "))
        self.proc.wait()
        texts, ids = last[str(new)]
        return {**self.info, "times": self.times[new], "prefill_times": self.times.get(1, []) if new != 1 else [],
                "generate_s": median(self.times[new]), "texts": texts, "ids": ids}


def side_by_side(backend, model_dir: str, prompts: list[str], a, caching: bool, plans: dict, times: dict) -> dict:
    """vLLM's engine started (apart from the timings), then ``a.repeats`` rounds of the harness's default plan
    and vLLM in turn, and with prefix caching on, of each one's prefill alone (one new token a prompt)."""
    engine = VLLMChild(model_dir, prompts, caching)
    news = (a.max_new_tokens, 1) if caching else (a.max_new_tokens,)
    paired = []  # vLLM's time over the harness's, round by round: the two ran back to back, under the same drift
    for _ in range(a.repeats):
        for new in news:
            out = run_harness(backend, prompts, new, "auto")
            key = "auto" if new == a.max_new_tokens else "auto prefill"
            times.setdefault(key, []).append(out[1])
            if key == "auto":
                plans["auto"] = (out[0], median(times["auto"]), out[2])
            theirs = engine.run(new)
            if key == "auto":
                paired.append(theirs / out[1])
    return {**engine.close(a.max_new_tokens), "paired": paired}


def spread(times: list[float]) -> str:
    return f"; {len(times)} runs {min(times):.2f}-{max(times):.2f} s" if len(times) > 1 else ""


def repeated(repeats: int, fn, *args):
    """``fn(*args)`` (a result whose second item is its seconds) ``repeats`` times: the last result with the
    median time in its place, and every time."""
    runs = [fn(*args) for _ in range(repeats)]
    times = [r[1] for r in runs]
    return (runs[-1][0], median(times), *runs[-1][2:]), times


class Progress:
    """One line on stderr per system timed, with its wall time, so a long run says where it is."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def __call__(self, what: str, fn, *args, **kw):
        self.done += 1
        print(f"[{self.done}/{self.total}, {time.perf_counter() - self.t0:.0f} s] timing {what} ...", file=sys.stderr,
              flush=True)
        return fn(*args, **kw)


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--positions", default="first,middle,last")
    ap.add_argument("--distractors", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--lm-eval-batch-size", default="8")
    ap.add_argument("--icr-batch-size", default="8", help="batch size of lm-eval's icr model (this harness inside it)")
    ap.add_argument("--plans", default=",".join(PLANS), help="the engine's plans to time")
    ap.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                    help="vllm: add vLLM (prefix caching on and off) beside the harness's default plan")
    ap.add_argument("--arch", choices=["phi", "phi-mamba", "hybrid-phi-mamba"], default="phi",
                    help="the tiny model's family (the Phi-Mamba ones: the harness's plan none is the baseline)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time the default plan and vLLM this many times each (vLLM's prefix cache emptied before "
                         "each) and, beside vLLM, their prefill alone as often: medians printed, with the range")
    a = ap.parse_args()
    own = a.arch != "phi"  # the project's own checkpoints: no transformers model, no lm-eval hf model
    if own and "none" not in a.plans.split(","):
        a.plans += ",none"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("harness").setLevel(logging.WARNING)
    rows = load_rows("fixture")[: a.questions]
    task = HotpotQA(distractors=a.distractors, positions=parse_positions(a.positions))
    inst = task.instances(rows, seed=1234)
    tpl = PromptTemplate("hotpotqa_cot")
    prompts = [tpl.render(**task.template_vars(i)) for i in inst]
    with tempfile.TemporaryDirectory() as d:
        model_dir = str(make_tiny_model(Path(d) / "m", a.arch, hidden=a.hidden, layers=a.layers,
                                        **({"init_std": 0.2} if own else {})))  # 0.5: activations of 1e5
        backend = load_backend(model_dir, "cpu", "float32")
        ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
        prompt_tokens, tree_tokens = sum(map(len, ids)), PrefixTree(ids).tree_tokens
        print(f"{len(prompts)} prompts (4-shot, {a.distractors} distractors), {min(map(len, ids))}-{max(map(len, ids))} "
              f"tokens, max {a.max_new_tokens} new; random {a.arch} d={a.hidden} L={a.layers}, CPU, "
              f"{torch.get_num_threads()} threads, freed memory "
              f"{'kept' if cpu_heap.keep_freed_memory(torch.device('cpu')) else 'given back'} (cpu_heap)\n")
        cachings = (False,) if own else (True, False)
        progress = Progress(len(a.plans.split(",")) + (0 if own else 3)
                            + (len(cachings) - ("auto" in a.plans.split(",")) if a.backend == "vllm" else 0))
        run_harness(backend, prompts[:2], 4, "none")  # warm-up
        plans, times, vllm = {}, {}, {}
        for p in a.plans.split(","):
            if p != "auto" or a.backend != "vllm":
                plans[p], times[p] = progress(f"the harness, plan {p}", repeated, a.repeats if p == "auto" else 1,
                                              run_harness, backend, prompts, a.max_new_tokens, p)
        for caching in cachings if a.backend == "vllm" else ():
            vllm[caching] = progress(f"vLLM, prefix caching {'on' if caching else 'off'}, in turn with the harness's "
                                     "default", side_by_side, backend, model_dir, prompts, a, caching, plans, times)
        if own:
            gen, t_gen, _ = plans["none"]
            lme = lmi = t_lme = t_lmi = None
        else:
            stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # as a user loads it
            gen, t_gen, gen_ids = progress("transformers.generate, one sample at a time", run_generate, stock,
                                           backend.tokenizer, prompts, a.max_new_tokens)
            lme, t_lme = progress("lm-eval's hf model", run_lm_eval, model_dir, prompts, a.max_new_tokens,
                                  a.lm_eval_batch_size)
            lmi, t_lmi = progress("lm-eval's icr model", run_lm_eval, model_dir, prompts, a.max_new_tokens,
                                  a.icr_batch_size, model="icr")
        print(file=sys.stderr)
    n = len(prompts)
    bound = prompt_tokens / tree_tokens
    print(f"{'system':48s} {'seconds':>8s} {'samples/s':>10s} {'vs generate':>12s} {'of bound':>9s} "
          f"{'prefilled':>10s} identical")
    base = "icr-harness, plan none (the baseline)" if own else "transformers.generate, one sample at a time"
    print(f"{base:48s} {t_gen:8.2f} {n / t_gen:10.2f} {'1.00x':>12s} {1 / bound:9.0%} {prompt_tokens:10d} -")
    for p, (out, t, info) in plans.items():
        label = f"icr-harness generate_all, plan {p}" + (f" -> {info.ran}" if p == "auto" else "")
        print(f"{label:48s} {t:8.2f} {n / t:10.2f} {t_gen / t:11.2f}x {t_gen / t / bound:9.0%} "
              f"{info.prefill_tokens:10d} {out == gen}{spread(times[p])}")
        if not own:
            explain_differences(backend, prompts, out, gen, gen_ids, "generate")
    if own:
        print(f"transformers.generate and lm-eval: cannot load a {a.arch} checkpoint - rows left out")
    elif lme is None:
        print("lm-eval: not installed (pip install lm-eval) - rows skipped")
    else:
        for label, texts, t in ((f"lm-eval hf, batch_size {a.lm_eval_batch_size}", lme, t_lme),
                                (f"lm-eval icr (this harness), batch_size {a.icr_batch_size}", lmi, t_lmi)):
            print(f"{label:48s} {t:8.2f} {n / t:10.2f} {t_gen / t:11.2f}x {t_gen / t / bound:9.0%} {'':>10s} "
                  f"{texts == gen}")
            if "icr" in label:
                explain_differences(backend, prompts, texts, gen, gen_ids, "generate")
    for caching, v in vllm.items():
        t = v["generate_s"]
        label = f"{v['vllm']}, prefix caching {'on' if caching else 'off'}"
        print(f"{label:48s} {t:8.2f} {n / t:10.2f} {t_gen / t:11.2f}x {t_gen / t / bound:9.0%} {'':>10s} "
              f"{sum(a == b for a, b in zip(v['texts'], gen))}/{n}  (engine start {v['start_s']:.1f} s apart; "
              f"{v['threads']} threads, freed memory {'kept' if v['heap'] else 'given back'}{spread(v['times'])})")
        explain_differences(backend, prompts, gen, v["texts"], v["ids"], "vLLM")
    auto = plans.get("auto")
    if auto is not None and vllm:
        on = (f"{vllm[True]['generate_s'] / auto[1]:.2f}x vLLM's speed with prefix caching on, " if True in vllm
              else "")
        print(f"\nharness default ({auto[2].ran}) vs vLLM: {on}{vllm[False]['generate_s'] / auto[1]:.2f}x with "
              "it off (> 1: the harness is faster)")
        for caching, v in vllm.items():
            if len(v["paired"]) > 1:
                r = sorted(v["paired"])
                print(f"  round by round (each harness run beside the vLLM run after it), prefix caching "
                      f"{'on' if caching else 'off'}: median {median(r):.2f}x, {r[0]:.2f}-{r[-1]:.2f}x over {len(r)}")
        if True in vllm and (measuring := cost_model_seconds(backend, auto[2])):
            print(f"the default plan read its cost model from the cache folder in each timed run; a machine's "
                  f"first run measures it, {measuring:.2f} s once (as vLLM's engine start profiles, timed apart): "
                  f"with it the harness would be {vllm[True]['generate_s'] / (auto[1] + measuring):.2f}x vLLM's "
                  "speed with prefix caching")
        if vllm.get(True, {}).get("prefill_times"):  # where each system's time goes: its prompts, its new tokens
            mine, theirs = median(times["auto prefill"]), median(vllm[True]["prefill_times"])
            print(f"prefill alone (1 new token a prompt), median of {a.repeats}: harness {mine:.2f} s, vLLM (prefix "
                  f"caching on) {theirs:.2f} s; the {a.max_new_tokens - 1} decode steps after it: harness "
                  f"{auto[1] - mine:.2f} s, vLLM {vllm[True]['generate_s'] - theirs:.2f} s. With decoding free the "
                  f"harness would be {vllm[True]['generate_s'] / mine:.2f}x vLLM's speed")
    if auto is not None:
        print(f"\nbound (prompt tokens / prefix tree's distinct tokens): {bound:.2f}x; the default plan "
              f"({auto[2].ran}) reaches {t_gen / auto[1]:.2f}x = {t_gen / auto[1] / bound:.0%} of it (goal >= 80%): "
              f"{bound:.2f}x from computing each distinct token once, {t_gen / auto[1] / bound:.2f}x from the rest "
              "(each token's cost: the harness's kernels against transformers' forward; per-call overheads)"
              + (f", {t_lme / auto[1]:.2f}x lm-eval hf's speed (goal > 1)" if lme is not None else ""))
        timed = {p: t for p, (_, t, _) in plans.items() if p != "auto"}
        if timed:
            fastest = min(timed, key=timed.get)
            print(f"fastest forced plan: {fastest} ({timed[fastest]:.2f} s); auto picked {auto[2].ran} "
                  f"(estimates: {auto[2].to_json().get('plan_estimates_s')})")


if __name__ == "__main__":
    main()
