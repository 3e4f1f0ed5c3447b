"""HotpotQA with the gold paragraphs moved through the context: the document-position experiment.

Rows are read in the official JSON schema (``_id``, ``question``, ``answer``, ``supporting_facts``,
``context`` = [[title, [sentences]]], ``type``, ``level``). For every question the distractor set and its
order are drawn once (seeded by question id), and only the place of the two gold paragraphs changes across
positions, so position effects are not confounded with different distractors."""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable
from unittest import mock

from evals import metrics
from evals.base import DataError, Instance, OptionError, Task, ToolSpec, read_utf8
from evals.fixture import FIXTURE_PATH
from evals.metrics import ANSWER_PHRASE
from evals.registry import register_task
from harness import hub
from harness.files import write_atomic
from harness.hashing import content_sha256
from retrieval import RetrievalTool

log = logging.getLogger("harness")

MAX_TOOL_CALLS = 4  # --max-tool-calls' default for HotpotQA: the exemplars make at most two calls
POSITION_KINDS = ("first", "middle", "last", "random")
OFFICIAL_DEV_URL = "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json"


# ----------------------------------------------------------------------------------------------- data
def load_rows(data: str | None, split: str = "validation") -> list[dict]:
    """Load rows from a JSON/JSONL file, ``fixture`` (the bundled invented data) or ``hub`` (datasets)."""
    if data in (None, "", "hub"):
        return _load_from_hub(split)
    if data == "fixture":
        path = FIXTURE_PATH
    else:
        path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"HotpotQA data file {str(path)!r} does not exist. {_HOW_TO_GET}")
    text = read_utf8(path, "HotpotQA data file")
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):  # an error names the file's own line
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno}); each "
                                    "line must be one HotpotQA row as a JSON object") from None
    else:
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON ({e}); expected the official HotpotQA list of rows") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of rows (the official HotpotQA format), got {type(rows).__name__}")
    for i, row in enumerate(rows):
        validate_row(row, i)
    return rows


_HOW_TO_GET = (
    "Get the official file (e.g. hotpot_dev_distractor_v1.json from the HotpotQA site, "
    f"{OFFICIAL_DEV_URL}) and pass --data PATH, use --data hub with a reachable Hugging Face hub or a filled "
    "HF cache (dataset 'hotpot_qa', config 'distractor'; `hf download hotpot_qa --repo-type dataset` where the hub "
    "is reachable), or try the pipeline on the bundled invented data with --data fixture."
)


def _load_from_hub(split: str) -> list[dict]:
    # offline: the cache only, no minute of retries; set for this load alone (stdlib's patch.dict restores it)
    offline = {"HF_DATASETS_OFFLINE": "1"} if hub.offline() else {}
    try:
        with mock.patch.dict(os.environ, offline):
            import datasets  # lazy: an optional install, needed only for --data hub

            ds = datasets.load_dataset("hotpot_qa", "distractor", split=split)
    except Exception as e:  # offline, no cache, or a hub error: all end in the same advice
        raise DataError(f"could not load HotpotQA through `datasets` ({type(e).__name__}: {e}). {_HOW_TO_GET}") from e
    rows = [_from_hf_schema(r) for r in ds]
    for i, row in enumerate(rows):
        validate_row(row, i)
    return rows


def _from_hf_schema(r: dict) -> dict:
    """The hub copy stores columns as dicts of lists; convert to the official list-of-pairs schema."""
    ctx = r["context"]
    sf = r["supporting_facts"]
    return {"_id": r["id"], "question": r["question"], "answer": r["answer"], "type": r.get("type"),
            "level": r.get("level"),
            "supporting_facts": [[t, int(s)] for t, s in zip(sf["title"], sf["sent_id"])],
            "context": [[t, list(s)] for t, s in zip(ctx["title"], ctx["sentences"])]}


def validate_row(row: Any, index: int) -> None:
    """Raise DataError naming the row and field when a row does not follow the official schema."""
    rid = row.get("_id", "?") if isinstance(row, dict) else "?"
    where = f"HotpotQA row {index} (id {rid!r})"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    for key, typ in (("_id", str), ("question", str), ("answer", str), ("supporting_facts", list), ("context", list)):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}")
        if not isinstance(row[key], typ):
            raise DataError(f"{where}: field {key!r} must be a {typ.__name__}, got {type(row[key]).__name__}")
    for key in ("_id", "question", "answer"):
        _check_text(row[key], where, key)
    titles = set()
    for j, para in enumerate(row["context"]):
        if not (isinstance(para, (list, tuple)) and len(para) == 2 and isinstance(para[0], str)
                and isinstance(para[1], list) and all(isinstance(s, str) for s in para[1])):
            raise DataError(f"{where}: field 'context[{j}]' must be [title, [sentence, ...]]")
        titles.add(para[0])
        for k, text in enumerate([para[0], *para[1]]):
            _check_text(text, where, f"context[{j}]" + ("[0]" if k == 0 else f"[1][{k - 1}]"))
    for j, fact in enumerate(row["supporting_facts"]):
        if not (isinstance(fact, (list, tuple)) and len(fact) == 2 and isinstance(fact[0], str)):
            raise DataError(f"{where}: field 'supporting_facts[{j}]' must be [title, sentence_index]")
        if fact[0] not in titles:
            raise DataError(f"{where}: field 'supporting_facts[{j}]' names title {fact[0]!r}, absent from 'context'")


def _check_text(text: str, where: str, field: str) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800") that no UTF-8 file or tokenizer can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: field {field!r} holds an invalid character ({e.reason} at offset {e.start}: "
                        f"{text[max(0, e.start - 20):e.start]!r}...); fix or drop that text in the data file") from None


# ----------------------------------------------------------------------------------------- positions
def parse_positions(spec: str | Iterable[str]) -> list[str]:
    """'first,middle,last,3,random' → a list; each item a kind in POSITION_KINDS or a non-negative index."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if str(s).strip()]
    if not items:
        raise ValueError("--positions is empty; use e.g. first,middle,last")
    for it in items:
        if it not in POSITION_KINDS and not it.isdigit():
            raise ValueError(f"unknown position {it!r}; use {', '.join(POSITION_KINDS)} or a paragraph index (0 = first)")
    return list(dict.fromkeys(items))


def gold_start(position: str, n_distractors: int, rng: random.Random) -> int:
    """Index of the first of the two (adjacent) gold paragraphs among n_distractors + 2 slots."""
    if position == "first":
        return 0
    if position == "last":
        return n_distractors
    if position == "middle":
        return n_distractors // 2
    if position == "random":
        return rng.randint(0, n_distractors)
    idx = int(position)
    if idx > n_distractors:
        raise ValueError(f"position index {idx} is past the end: with {n_distractors} distractors the gold pair "
                         f"can start at 0..{n_distractors}")
    return idx


# ------------------------------------------------------------------------------------------- task
@dataclass
class QAInstance(Instance):
    """A question over paragraphs in a fixed order (distractors and gold, placed by the condition)."""

    question: str = ""
    paragraphs: list[dict[str, Any]] = field(default_factory=list)  # [{"title", "sentences", "text", "gold"}]

    def template_vars(self) -> dict[str, Any]:
        return {"question": self.question, "paragraphs": self.paragraphs, "meta": self.meta}

    def retrieval_units(self) -> list[str]:
        """The texts the retrieval tool searches: the test context's sentences, never the exemplars'."""
        return [f"{p['title']}: {s.strip()}" for p in self.paragraphs for s in p["sentences"] if s.strip()]


@dataclass
class HotpotQAOptions:
    """HotpotQA's own options; ``harness.eval`` also takes them as --distractors, --positions and --shots
    (``"flag": True``)."""

    distractors: int = field(default=8, metadata={"help": "distractor paragraphs per test context; >8 draws extra "
                                                          "ones (seeded) from other questions; 0 = oracle mode, "
                                                          "the gold paragraphs only", "flag": True})
    positions: list[str] = field(default_factory=lambda: ["first", "middle", "last"], metadata={
        "help": "where the two gold paragraphs go: first, middle, last, random, an index (0 = first), or a comma "
                "list swept in one run (not with distractors 0)", "selects": True, "flag": True})
    shots: int = field(default=4, metadata={"help": "few-shot exemplars shown", "flag": True})

    def check(self) -> None:
        if self.distractors < 0:
            raise OptionError(f"--distractors {self.distractors}: use 0 (oracle: gold paragraphs only) or more")
        if self.shots < 0:
            raise OptionError(f"--shots {self.shots}: use 0 or more exemplars")
        try:
            self.positions = parse_positions(",".join(self.positions) if not isinstance(self.positions, str)
                                             else self.positions)
        except ValueError as e:
            raise OptionError(f"--positions: {e}") from None


@register_task("hotpotqa")
class HotpotQA(Task):
    """4-shot chain-of-thought HotpotQA with controlled gold-paragraph positions."""

    Options = HotpotQAOptions
    default_template = "hotpotqa_cot"
    retrieval_template = "hotpotqa_cot_retrieval"
    stop = ["\n\n", "\nQuestion:", "\nParagraph:"]
    default_max_new_tokens = 96
    metrics = ("em", "f1", "contains")
    binary_metrics = ("em", "contains")
    seed_reaches_data = True
    official_scorer = "hotpot_evaluate_v1.py"
    condition = "position"
    axis_statistic = "gold_start"
    axis_label = "slot of the first gold paragraph (0 = first in the context)"

    def __init__(self, data: str | None = None, split: str | None = "validation", **options):
        super().__init__(data, split or "validation", **options)

    @classmethod
    def check_given(cls, given: dict) -> None:
        if str(given.get("distractors")) == "0" and "positions" in given:
            raise OptionError(f"--positions {given['positions']} has no effect with --distractors 0 (oracle mode: the "
                              "gold paragraphs alone, position 'oracle'); drop --positions or use --distractors 1 or "
                              "more")

    @classmethod
    def label(cls, option: str, value) -> str:
        if option == "distractors":
            return "oracle" if value == 0 else f"k={value}"
        return super().label(option, value)

    @classmethod
    def output_tag(cls, options: dict) -> str:
        return f"-k{options['distractors']}"

    def load(self) -> list[dict]:
        return load_rows(self.data, self.split)

    def instances(self, rows: list[dict], *, seed: int, pool_rows: list[dict] | None = None) -> list[Instance]:
        """``pool_rows`` (default: ``rows``) supply extra distractors; pass the whole dataset so that a
        question's context does not depend on --limit or --ids."""
        distractors = self.options.distractors
        positions = ["oracle"] if distractors == 0 else self.options.positions
        pool = _paragraph_pool(pool_rows if pool_rows is not None else rows)
        no_gold = [r["_id"] for r in rows if not r["supporting_facts"]]
        if no_gold:
            # no gold paragraph: its "position" would mean nothing, and it would join the position curve
            log.warning("%d HotpotQA row(s) have no supporting facts (no gold paragraph), so no gold position; they "
                        "are left out of this run (their paragraphs may still serve as distractors): %s%s",
                        len(no_gold), ", ".join(no_gold[:5]), ", ..." if len(no_gold) > 5 else "")
            if len(no_gold) == len(rows):
                raise DataError("every selected HotpotQA row lacks supporting facts, so none has a gold paragraph "
                                "to place; give rows with 'supporting_facts'")
        out = []
        for row in rows:
            if not row["supporting_facts"]:
                continue
            gold_titles = list(dict.fromkeys(t for t, _ in row["supporting_facts"]))
            by_title = {t: s for t, s in row["context"]}
            gold = [_para(t, by_title[t], True) for t in gold_titles]
            rng = random.Random(f"{seed}:{row['_id']}")
            distr = self._draw_distractors(row, gold_titles, distractors, pool, rng)
            for pos in positions:
                start = 0 if pos == "oracle" else gold_start(pos, distractors, random.Random(f"{seed}:{row['_id']}:pos"))
                paras = distr[:start] + gold + distr[start:]
                out.append(QAInstance(id=row["_id"], condition=pos, question=row["question"], answer=row["answer"],
                                      paragraphs=paras, meta={"gold_start": start, "type": row.get("type"),
                                                              "level": row.get("level"), "n_paragraphs": len(paras)}))
        return out

    @staticmethod
    def _draw_distractors(row, gold_titles, k, pool, rng) -> list[dict]:
        own = [_para(t, s, False) for t, s in row["context"] if t not in gold_titles]
        if k <= len(own):
            chosen = sorted(rng.sample(range(len(own)), k))
            return [own[i] for i in chosen]
        taken = {t for t, _ in row["context"]}
        extra = []
        for i in rng.sample(range(len(pool)), len(pool)):
            title, sents = pool[i]
            if title not in taken:
                taken.add(title)
                extra.append(_para(title, sents, False))
                if len(own) + len(extra) == k:
                    break
        else:
            raise DataError(f"asked for {k} distractors but the data holds only {len(own) + len(extra)} distinct "
                            f"paragraphs usable for question {row['_id']!r}; use fewer --distractors or more rows")
        mixed = own + extra
        rng.shuffle(mixed)
        return mixed

    def template_vars(self, instance: Instance) -> dict[str, Any]:
        return {**instance.template_vars(), "shots": self.options.shots}

    def make_tool(self, instance: Instance, spec: ToolSpec):
        """With --retrieval: the regex tool over this instance's test paragraphs (never the exemplars)."""
        if not spec.enabled:
            return None

        max_calls = spec.max_calls if spec.max_calls is not None else MAX_TOOL_CALLS
        return RetrievalTool(instance.retrieval_units(), max_calls=max_calls, timeout=spec.timeout,
                             max_chars=spec.max_chars)

    def record_fields(self, instance: Instance) -> dict[str, Any]:
        return {"gold_start": instance.meta["gold_start"]}

    def evidence(self, instance: Instance) -> list[tuple[str, str]]:
        golds = [(slot, p) for slot, p in enumerate(instance.paragraphs) if p.get("gold")]
        return [*((p["text"], f"gold paragraph {k} of {len(golds)}: {p['title']} (slot {slot})")
                  for k, (slot, p) in enumerate(golds, 1)), (instance.question, "question")]

    @classmethod
    def official_gold(cls, config: dict, resolved: dict, scored: dict[str, set[str]]) -> dict[str, list[dict]]:
        """The official-format gold rows per position, cut to the ids scored there: ``hotpot_evaluate_v1.py``
        on them and the run's predictions/ prints the harness's EM and F1 (the official script divides by every
        gold row, and counts a row without a prediction as 0)."""
        rows = cls(data=config.get("data"), split=config.get("split", "validation")).load()
        want = resolved.get("data_sha256")
        if want and content_sha256(rows) != want:
            raise DataError(f"the data {config.get('data')!r} changed since the run (content hash "
                            f"{content_sha256(rows)} vs {want}); point the run's --data at the file it used")
        return {pos: [r for r in rows if r["_id"] in ids] for pos, ids in scored.items()}

    def write_outputs(self, records: list[dict], out_dir: Path, conditions: list[str]) -> list[str]:
        write_predictions(records, out_dir, conditions)
        return ["predictions/"]

    def describe(self, template_variables: set[str] | None = None) -> str:
        """``template_variables``: what the template reads; one that never shows ``shots`` is zero-shot."""
        o = self.options
        shots = o.shots if template_variables is None or "shots" in template_variables else 0
        return f"{o.distractors} distractors, {shots}-shot"

    # scoring -------------------------------------------------------------------------------------
    answer_phrase = ANSWER_PHRASE  # a template's ``{% set answer_phrase = ... %}`` overrides it

    def score(self, instance: Instance, generation: str, answer_phrase: str | None = None) -> dict[str, Any]:
        answer, found = metrics.extract_answer(generation, answer_phrase or self.answer_phrase)
        return {"prediction": answer, "answer_found": found, **metrics.score(answer, instance.answer, found)}


def write_predictions(records: Iterable[dict], out_dir: Path, positions: list[str]) -> list[Path]:
    """Official HotpotQA prediction files ({"answer": {id: text}, "sp": {id: []}}), one per position, written
    for every position (empty if nothing was scored); files of positions no longer in the run are removed.
    A generation without an answer scores 0 here; written as "" it would score EM 1 in the official script
    against a gold that normalises to "" (e.g. "A"), so it is written as a text that matches no part of its gold."""
    by_pos: dict[str, dict] = {p: {"answer": {}, "sp": {}} for p in positions}
    for r in records:
        if not r.get("skipped") and r["condition"] in by_pos:
            pred = r["prediction"] if r.get("answer_found", True) else metrics.no_answer_text(r["gold"])
            by_pos[r["condition"]]["answer"][r["id"]] = pred
            by_pos[r["condition"]]["sp"][r["id"]] = []
    pred_dir = out_dir / "predictions"
    pred_dir.mkdir(exist_ok=True)
    paths = [write_atomic(pred_dir / f"{pos}.json", json.dumps(preds, indent=1, ensure_ascii=False))
             for pos, preds in by_pos.items()]
    for stale in set(pred_dir.glob("*.json")) - set(paths):
        stale.unlink()
        log.info("removed %s: position %s is not part of this run", stale, stale.stem)
    return paths


def _para(title: str, sentences: list[str], gold: bool) -> dict:
    return {"title": title, "sentences": sentences, "text": "".join(sentences).strip(), "gold": gold}


def _paragraph_pool(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """All distinct paragraphs in the data: the source of distractors beyond a question's own eight."""
    seen, pool = set(), []
    for row in rows:
        for t, s in row["context"]:
            if t not in seen:
                seen.add(t)
                pool.append((t, s))
    return pool
