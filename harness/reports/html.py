"""``report.html``: the report's tables, figures and paired differences, and a sample explorer over every row of
every run, in one file that opens from the disk (no server, no network: styles, script, figures and data inline).

The explorer shows why a row failed: the question, the context with the task's evidence marked (HotpotQA's gold
paragraphs and their slots, as the engine recorded them), the generation with each tool call and its result,
the extracted and gold answers and the scores; and one question across every run side by side, discordant pairs
first, one click from each paired difference. Written by hand (a page and ~300 lines of script) because the
viewers researchers use (Inspect's log viewer, Zeno, HELM's front end) show samples but not the same question
across runs with the evidence's position marked.

At the full HotpotQA dev set (22k rows of ~2k-token prompts) the rows' text would be ~180 MB; it stays small
because every prompt is cut into lines that are stored once (the few-shot exemplars and each paragraph recur
across rows and positions) and the data is gzipped into the page, unpacked by the browser's own
DecompressionStream after the tables have painted. Sample text is only ever set as text, never as markup."""
from __future__ import annotations

import base64
import gzip
import json
import re
from pathlib import Path
from typing import Any

import jinja2

from evals import task_class
from harness.reports.paired import matcher, pairing, same_question

TEMPLATE = Path(__file__).with_name("report.html.j2")
MAX_GENERATION = 100_000  # characters of a generation kept in the page (the rest is in samples.jsonl)


class Strings:
    """A table of distinct strings: each stored once, referred to by index."""

    def __init__(self):
        self.index: dict[str, int] = {}
        self.items: list[str] = []

    def add(self, text: str) -> int:
        at = self.index.get(text)
        if at is None:
            at = self.index[text] = len(self.items)
            self.items.append(text)
        return at


def _segments(prompt: str) -> list[str]:
    """A prompt as lines (newlines kept): the few-shot exemplars and every paragraph recur across rows."""
    return re.split(r"(?<=\n)", prompt) if prompt else []


def _outcome(rec: dict, metric: str) -> int:
    """0 correct (full credit on the plotted metric), 1 wrong, 2 skipped."""
    if rec.get("skipped") or "scores" not in rec:
        return 2
    value = rec["scores"].get(metric)
    return 0 if value is not None and float(value) >= 1 - 1e-9 else 1


def explorer_data(runs: list[dict], plotted: dict[str, str], diffs: list) -> dict[str, Any]:
    """What the page's script reads. ``runs``: label, dir, task, condition name, and the rows the report counted."""
    strings = Strings()
    out_runs, rows, by_label = [], [], {}
    several = len({run["task"] for run in runs}) > 1
    for i, run in enumerate(runs):
        task = run["task"]
        metrics = list(task_class(task).metrics)
        by_label[(task, run["label"])] = i  # labels tell a task's runs apart; two tasks' runs may share one
        out_runs.append({"label": f"{run['label']} · {task}" if several else run["label"], "dir": run["dir"],
                         "task": task, "condition": run["condition_name"], "metrics": metrics,
                         "metric": plotted[task], "settings": run.get("settings") or {}})
        for rec in run["rows"]:
            generation = rec.get("generation") or ""
            cut = len(generation) > MAX_GENERATION
            calls = [[c.get("pattern", ""), c.get("status", ""), c.get("result", "")]
                     for c in rec.get("tool_calls") or []]
            rows.append([i, rec["key"], rec["id"], str(rec["condition"]), _outcome(rec, plotted[task]),
                         1 if calls else 0, str(rec.get("gold", "")), str(rec.get("prediction") or ""),
                         [rec.get("scores", {}).get(m) for m in metrics],
                         [strings.add(s) for s in _segments(rec.get("prompt") or "")], rec.get("evidence") or [],
                         generation[:MAX_GENERATION] + ("\n[... cut here: the whole generation is in samples.jsonl]"
                                                        if cut else ""),
                         calls, rec.get("finish_reason") or rec.get("skipped") or "", rec.get("prompt_tokens")])
    return {"runs": out_runs, "strings": strings.items, "rows": rows,
            "diffs": [_diff_entry(d, by_label, runs) for d in diffs]}


def _diff_entry(d, by_label: dict, runs: list[dict]) -> dict:
    """A paired difference and the rows behind it: (a key, b key) of every pair, discordant pairs first. The
    pairs are ``harness.reports.paired.pairing``'s, with the keys and tests ``harness.report.comparisons`` used."""
    by_label = {label: i for (task, label), i in by_label.items() if task == d.task}
    if d.a in by_label and d.b in by_label:  # two runs, one condition (or all shared ones)
        ra, rb = by_label[d.a], by_label[d.b]
        pick = (lambda r: True) if d.condition == "all" else (lambda r: str(r["condition"]) == d.condition)
        got = pairing([r for r in runs[ra]["rows"] if pick(r)], [r for r in runs[rb]["rows"] if pick(r)],
                      key=lambda r: (r["id"], str(r["condition"])),
                      same=matcher(runs[ra].get("data_sha256"), runs[rb].get("data_sha256")))
    else:  # one run, two conditions of each question
        ra = rb = by_label.get(d.condition)
        rows = runs[ra]["rows"] if ra is not None else []
        got = pairing([r for r in rows if str(r["condition"]) == d.a], [r for r in rows if str(r["condition"]) == d.b],
                      key=lambda r: r["id"], same=same_question)
    pairs = [(got.side_a[k], got.side_b[k]) for k in got.both]
    metric = d.metric
    discordant = [p for p in pairs if p[0]["scores"].get(metric) != p[1]["scores"].get(metric)]
    rest = [p for p in pairs if p[0]["scores"].get(metric) == p[1]["scores"].get(metric)]
    return {"line": d.line(), "metric": metric, "significant": d.significant, "discordant": len(discordant),
            "pairs": [[x["key"], y["key"], x["id"]] for x, y in discordant + rest], "runs": [ra, rb],
            "a": d.a, "b": d.b,  # McNemar's 2x2 (0/1 metrics): [[both right, only a], [only b, both wrong]]
            "table": [[d.concordant[0], d.discordant[0]], [d.discordant[1], d.concordant[1]]]
            if d.discordant is not None and d.concordant is not None else None}


def pack(data: dict) -> str:
    """The explorer's data as gzipped JSON in base64 (the page unpacks it with DecompressionStream)."""
    # a lone surrogate (valid JSON, e.g. in a generation) becomes its JSON escape; a non-finite number is refused
    # (JSON.parse would reject the whole page's data), never written
    raw = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8",
                                                                                               "backslashreplace")
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


def png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def render_html(*, title: str, tables: list[tuple[str, str]], pngs: list[Path], diffs: list,
                seeds: list[str], notes: list[str], runs: list[dict], plotted: dict[str, str], direction: str = "",
                legend: str = "") -> str:
    """The page. ``tables``: (heading, HTML table) per task, escaped by pandas; everything else is escaped by Jinja
    or set as text by the script."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    page = env.from_string(TEMPLATE.read_text()).render(
        title=title, tables=[(h, jinja2.utils.markupsafe.Markup(t)) for h, t in tables],
        figures=[(p.name, png_data_uri(p)) for p in pngs], seeds=seeds, notes=notes, direction=direction,
        legend=legend, data=pack(explorer_data(runs, plotted, diffs)))
    return page
