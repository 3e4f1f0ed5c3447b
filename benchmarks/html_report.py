"""report.html at the scale of the full HotpotQA dev set: size on disk and load time in headless Chromium.

    python benchmarks/html_report.py [--questions 7405] [--positions first,middle,last]

Builds rows as a run of the paper's experiment writes them (the real task, template and record format over a
generated HotpotQA-format file: 10 paragraphs a question, 4-shot CoT prompts of ~2k tokens, generations of a few
hundred characters with tool calls), writes the page with the report's own writer, and opens it in Debian's
Chromium through Selenium: time to first contentful paint (the tables) and until the sample explorer is ready
(its data unpacked and the first page of rows drawn). Needs `apt-get install chromium chromium-driver` and
selenium (the dev extra)."""
from __future__ import annotations

import itertools
import json
import random
import tempfile
import time
from pathlib import Path

from evals.base import ToolSpec
from evals.hotpotqa import HotpotQA
from harness.engine.prompting import PromptTemplate
from harness.reports.html import render_html
from harness.tools.bench import benchmark_parser

# Invented words drawn by Zipf's law (a 20,000-word vocabulary): text about as compressible as English prose
# (gzip ~3x), so the page's size is not flattered by repetitive filler.
_rng = random.Random(0)
WORDS = ["".join(_rng.choice("etaoinshrdlcumwfgypbvkjxqz"[:12 + k % 14]) for _ in range(2 + k % 9))
         for k in range(20000)]
CUM = list(itertools.accumulate(1 / (k + 1) for k in range(len(WORDS))))


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, cum_weights=CUM, k=rng.randint(12, 22))).capitalize() + ". "


def hotpot_rows(n: int, seed: int = 0) -> list[dict]:
    """HotpotQA-format rows of invented text: 10 paragraphs (2 gold) of 3-5 sentences each."""
    rng = random.Random(seed)
    rows = []
    for q in range(n):
        titles = [" ".join(rng.choices(WORDS, cum_weights=CUM, k=3)).title() for k in range(10)]
        context = [[t, [_sentence(rng) for _ in range(rng.randint(3, 5))]] for t in titles]
        rows.append({"_id": f"q{q:05d}", "question": f"Which {rng.choice(WORDS)} of {titles[0]} is in {titles[1]}?",
                     "answer": rng.choice(WORDS), "type": "bridge", "level": "hard",
                     "supporting_facts": [[titles[0], 0], [titles[1], 1]], "context": context})
    return rows


def records(rows: list[dict], positions: list[str], seed: int = 1) -> list[dict]:
    """samples.jsonl rows as the engine writes them, for these questions at these positions."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "dev.json"
        data.write_text(json.dumps(rows))
        task = HotpotQA(data=str(data), distractors=8, positions=positions)
        instances = task.instances(task.load(), seed=1234, pool_rows=rows)
    tpl, tool = PromptTemplate("hotpotqa_cot_retrieval"), ToolSpec(enabled=True).template_vars()
    out = []
    for ins in instances:
        prompt = tpl.render(**task.template_vars(ins), tool=tool)
        answer = ins.answer if rng.random() < 0.4 else rng.choice(WORDS)
        result = " | ".join(f"{p['title']}: {p['sentences'][0].strip()}" for p in ins.paragraphs[:2])[:300]
        generation = (f" Let me look.<search>{ins.paragraphs[0]['title']}</search><result>{result}</result> "
                      + _sentence(rng) + f"So the answer is: {answer}.")
        evidence = [[prompt.rfind(p["text"]), prompt.rfind(p["text"]) + len(p["text"]), f"gold paragraph (slot {i})"]
                    for i, p in enumerate(ins.paragraphs) if p["gold"]]
        out.append({"key": ins.key, "id": ins.id, "condition": ins.condition, "prompt": prompt, "gold": ins.answer,
                    "generation": generation, "prediction": answer, "finish_reason": "eos", "skipped": None,
                    "scores": {"em": float(answer == ins.answer), "f1": float(answer == ins.answer),
                               "contains": float(answer == ins.answer)},
                    "tool_calls": [{"pattern": ins.paragraphs[0]["title"], "status": "ok", "result": result}],
                    "evidence": evidence, "prompt_tokens": len(prompt) // 4, "instance_sha256": ins.key})
    return out


def load_times(page: Path) -> tuple[float, float]:
    """(first contentful paint, explorer ready) in seconds from navigation start, in headless Chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        driver.set_page_load_timeout(300)
        t0 = time.perf_counter()
        driver.get(page.as_uri())
        WebDriverWait(driver, 300, poll_frequency=0.05).until(
            lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
        ready = time.perf_counter() - t0
        paint = driver.execute_script(
            "const p = performance.getEntriesByName('first-contentful-paint')[0]; return p ? p.startTime : null")
    finally:
        driver.quit()
    return (paint / 1000 if paint is not None else float("nan")), ready


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--questions", type=int, default=7405, help="HotpotQA dev has 7,405")
    ap.add_argument("--positions", default="first,middle,last")
    a = ap.parse_args()
    positions = a.positions.split(",")
    t0 = time.perf_counter()
    recs = records(hotpot_rows(a.questions), positions)
    raw = sum(len(json.dumps(r)) for r in recs)
    t1 = time.perf_counter()
    runs = [{"label": "phi-mamba +retrieval", "dir": "runs/bench", "task": "hotpotqa", "condition_name": "position",
             "rows": recs}]
    with tempfile.TemporaryDirectory() as d:
        page = Path(d) / "report.html"
        page.write_text(render_html(title="bench", tables=[], pngs=[], diffs=[], seeds=[], notes=[], runs=runs,
                                    plotted={"hotpotqa": "em"}), encoding="utf-8")
        t2 = time.perf_counter()
        size = page.stat().st_size
        browser = all(Path(p).exists() for p in ("/usr/bin/chromium", "/usr/bin/chromedriver"))
        paint, ready = load_times(page) if browser else (None, None)
    print(f"{len(recs):,} rows ({a.questions:,} questions x {len(positions)} positions), prompts "
          f"{min(len(r['prompt']) for r in recs):,}-{max(len(r['prompt']) for r in recs):,} characters; "
          f"samples.jsonl would hold {raw / 2**20:.0f} MiB")
    print(f"report.html: {size / 2**20:.1f} MiB ({raw / size:.0f}x smaller), written in {t2 - t1:.1f} s "
          f"(rows built in {t1 - t0:.1f} s)")
    if paint is None:
        print("load time: not measured, no browser here (apt-get install chromium chromium-driver)")
    else:
        print(f"headless Chromium: first contentful paint {paint:.2f} s, sample explorer ready {ready:.2f} s "
              "(goal: under 30 MiB and under 3 s to first paint)")


if __name__ == "__main__":
    main()
