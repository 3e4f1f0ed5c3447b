"""A finished run also written in lm-evaluation-harness's output format, so lm-eval's tooling (its results
tables, its ``get_latest_filename`` readers, the trackers and viewers built on them) reads the harness's runs:
``lm_eval/results_DATE.json`` and one ``lm_eval/samples_TASK_DATE.jsonl`` per condition.

Each condition is one lm-eval task, ``TASK_CONDITION`` (e.g. ``hotpotqa_first``), in a group named after the
task; metrics keep the harness's names with lm-eval's ``,none`` filter suffix; skipped rows (a prompt too long
for the model) are left out, as the harness's own metrics leave them out. The harness's files stay the record:
these are rewritten from them at every report, replacing the previous ones."""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

from harness.files import write_atomic, write_json

FOLDER = "lm_eval"


def task_name(task: str, condition: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{task}_{condition}").strip("_")


def _sha(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def write(out: Path, results: dict, records: list[dict], metrics: tuple[str, ...]) -> list[str]:
    """Write the lm-eval files of a run into ``out/lm_eval`` (earlier ones of this run replaced); their folder."""
    folder = Path(out) / FOLDER
    folder.mkdir(exist_ok=True)
    for old in [*folder.glob("results_*.json"), *folder.glob("samples_*.jsonl")]:
        old.unlink()
    finished = datetime.fromisoformat(results["finished"])
    stamp = finished.replace(tzinfo=None).isoformat().replace(":", "-")
    cfg, task = results["config"], results["task"]
    names = {cond: task_name(task, cond) for cond in results["metrics"]}
    payload = {
        "results": {}, "group_subtasks": {task: list(names.values())}, "configs": {}, "versions": {}, "n-shot": {},
        "higher_is_better": {}, "n-samples": {},
        "config": {"model": "icr", "model_args": f"pretrained={cfg['model']}", "batch_size": cfg.get("batch_size"),
                   "device": cfg.get("device"), "limit": cfg.get("limit"), "random_seed": cfg.get("seed"),
                   "gen_kwargs": {"max_gen_toks": cfg.get("max_new_tokens"), "do_sample": False}},
        "git_hash": results.get("git"), "date": finished.timestamp(), "model_name": cfg["model"],
        "total_evaluation_time_seconds": str((results.get("timings") or {}).get("total_s", "")),
        "icr_harness": {"config_hash": results["config_hash"], "results": "results.json"},
    }
    for cond, name in names.items():
        stats = results["metrics"][cond]
        row = {"alias": name}
        for m in metrics:
            row[f"{m},none"] = stats.get(m)
            row[f"{m}_stderr,none"] = stats.get(f"{m}_se", "N/A")
        payload["results"][name] = row
        payload["configs"][name] = {"task": name, "tag": task, "output_type": "generate_until",
                                    "metadata": {"condition": cond, "icr_config_hash": results["config_hash"]}}
        payload["versions"][name] = results["config_hash"]
        payload["n-shot"][name] = 0
        payload["higher_is_better"][name] = {m: True for m in metrics}
        payload["n-samples"][name] = {"original": stats.get("n", 0) + stats.get("skipped", 0),
                                      "effective": stats.get("n", 0)}
        lines = []
        for doc_id, r in enumerate(x for x in records if x["condition"] == cond and not x.get("skipped")):
            doc = {"id": r["id"], "condition": cond}
            lines.append(json.dumps({
                "doc_id": doc_id, "doc": doc, "target": r.get("gold"),
                "arguments": {"gen_args_0": {"arg_0": r.get("prompt"),
                                             "arg_1": {"max_gen_toks": cfg.get("max_new_tokens"), "do_sample": False}}},
                "resps": [[r.get("generation")]], "filtered_resps": [r.get("prediction")], "filter": "none",
                "metrics": list(metrics), "doc_hash": _sha(doc), "prompt_hash": r.get("prompt_sha256") or "",
                "target_hash": _sha(str(r.get("gold"))), **{m: (r.get("scores") or {}).get(m) for m in metrics},
            }, ensure_ascii=False, default=str))
        write_atomic(folder / f"samples_{name}_{stamp}.jsonl", "".join(line + "\n" for line in lines))
    write_json(folder / f"results_{stamp}.json", payload, indent=2, default=str)
    return [f"{FOLDER}/"]
