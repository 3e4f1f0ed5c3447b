"""Writes the bundled HotpotQA-schema fixture: invented people, towns and operas, so tests and the demo
run offline on data in the official format without copying any of HotpotQA itself.

Run ``python -m evals.fixture`` to regenerate ``evals/data/hotpotqa_fixture.json``."""
from __future__ import annotations

import json
import random
from pathlib import Path

FIXTURE_PATH = Path(__file__).parent / "data" / "hotpotqa_fixture.json"

_FIRST = ["Alvar", "Brisa", "Corin", "Delphine", "Emrys", "Fenna", "Gideon", "Halla", "Ivo", "Jessamy",
          "Kaspar", "Liesel", "Marek", "Nerys", "Oskar", "Perpetua", "Quill", "Rosalind", "Soren", "Tamsin"]
_LAST = ["Varga", "Holloway", "Brandt", "Okafor", "Lindqvist", "Maran", "Petrov", "Quenby", "Sallow", "Tiernan",
         "Ulmer", "Vance", "Wexley", "Yarrow", "Zeller", "Ashdown", "Birch", "Castell", "Dunmore", "Everly"]
_TOWNS = ["Karvell", "Ostrum", "Pellin", "Drosk", "Amberlee", "Tolvan", "Westmarch", "Quarry Cove", "Brennick",
          "Saltmere", "Harrowgate Fen", "Lunden Vale", "Myrtlebank", "Cindral", "Oakhallow", "Riversend"]
_COUNTRIES = ["Veloria", "Ostland", "Marivia", "Kestrania", "Dunholm", "Aurelis"]
_WORKS = ["The Glass Orchard", "Night of Lanterns", "The Winter Regent", "Song of the Ferryman",
          "The Copper Bell", "A Harbour in Spring", "The Silent Mill", "Queen of Ashes", "The Lark's Return",
          "The Drowned Chapel", "Midsummer Tide", "The Iron Garden"]
_KINDS = ["opera", "symphony", "ballet", "oratorio"]
_JOBS = ["composer", "painter", "architect", "poet", "cartographer", "astronomer"]


def _person_paragraph(name, job, town, country, year, rng):
    article = "an" if job[0] in "aeiou" else "a"
    return [name, [f"{name} (born {year}) is {article} {job} from {town}, {country}.",
                   f" {name.split()[0]} studied in {rng.choice(_TOWNS)} before settling in {town}."]]


def _town_paragraph(town, country, year, river):
    return [town, [f"{town} is a town in the north of {country}.",
                   f" It was founded in {year} on the banks of the {river} river."]]


def _work_paragraph(work, kind, author, year):
    return [work, [f"{work} is an {kind} by {author}." if kind[0] in "aeiou" else f"{work} is a {kind} by {author}.",
                   f" It was first performed in {year}."]]


def make_rows(n_questions: int = 24, seed: int = 0) -> list[dict]:
    """Build ``n_questions`` rows in the official HotpotQA schema (2 gold + 8 distractor paragraphs each)."""
    rng = random.Random(seed)
    people = {}
    while len(people) < 20:
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        people.setdefault(name, (rng.choice(_JOBS), rng.choice(_TOWNS), rng.choice(_COUNTRIES), rng.randint(1700, 1950)))
    towns = {t: (rng.choice(_COUNTRIES), rng.randint(900, 1800), rng.choice(["Ossel", "Marrow", "Tane", "Lisk"]))
             for t in _TOWNS}
    works = {w: (rng.choice(_KINDS), rng.choice(list(people)), rng.randint(1750, 1990)) for w in _WORKS}
    paras = {}
    for name, (job, town, country, year) in people.items():
        paras[name] = _person_paragraph(name, job, town, country, year, rng)
    for town, (country, year, river) in towns.items():
        paras[town] = _town_paragraph(town, country, year, river)
    for work, (kind, author, year) in works.items():
        paras[work] = _work_paragraph(work, kind, author, year)

    rows = []
    for q in range(n_questions):
        kind = ("bridge", "comparison_yesno", "comparison_entity")[q % 3]
        if kind == "bridge":
            work = _WORKS[q % len(_WORKS)]
            author = works[work][1]
            gold = [work, author]
            question = f"In which country was the author of the {works[work][0]} {work} born?"
            answer = people[author][2]
            sp = [[work, 0], [author, 0]]
        elif kind == "comparison_yesno":
            a, b = rng.sample(_TOWNS, 2)
            gold = [a, b]
            question = f"Are {a} and {b} in the same country?"
            answer = "yes" if towns[a][0] == towns[b][0] else "no"
            sp = [[a, 0], [b, 0]]
        else:
            a, b = rng.sample(_TOWNS, 2)
            while towns[a][1] == towns[b][1]:
                b = rng.choice(_TOWNS)
            gold = [a, b]
            question = f"Which town was founded first, {a} or {b}?"
            answer = a if towns[a][1] < towns[b][1] else b
            sp = [[a, 1], [b, 1]]
        pool = [t for t in paras if t not in gold]
        context = [paras[t] for t in rng.sample(pool, 8)] + [paras[t] for t in gold]
        rng.shuffle(context)
        rows.append({"_id": f"fx{q:04d}", "question": question, "answer": answer, "supporting_facts": sp,
                     "context": context, "type": "bridge" if kind == "bridge" else "comparison",
                     "level": ("easy", "medium", "hard")[q % 3]})
    return rows


def write_fixture(path: Path = FIXTURE_PATH, n_questions: int = 24, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(make_rows(n_questions, seed), indent=1) + "\n")
    return path


if __name__ == "__main__":
    print(write_fixture())
