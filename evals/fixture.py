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


# Sentences that lengthen a paragraph without touching what the questions ask (no countries, births, founding
# years or authorship): real HotpotQA paragraphs average about 110 GPT-2 tokens (37-171 over the first dev
# question's ten), the two facts above about 25.
_FILLER = {
    "person": ["{first} kept a notebook of {thing} for most of {their} life.",
               "A portrait of {first} by an unknown hand hangs in the library of {place}.",
               "Friends described {first} as patient, stubborn and fond of long walks along the {river}.",
               "{first} often said that the best ideas came during the winter months.",
               "Several letters written by {first} to a cousin survive in a private collection.",
               "In later years {first} taught evening classes on {thing} to anyone who asked.",
               "{first} travelled widely, though never further than a few weeks by coach.",
               "A small garden planted by {first} is still tended by volunteers.",
               "Critics have praised the careful attention to {thing} in {their} early work.",
               "{first} declined several honours, preferring to avoid public ceremonies.",
               "Records show that {first} paid for the repair of a bridge over the {river}.",
               "The family name appears in parish books as far back as anyone has looked."],
    "town": ["The town is known for its {thing} and a market held every {day}.",
             "Its oldest surviving building is a {building} near the {river}.",
             "Most of the houses in the old quarter are built of grey stone and slate.",
             "A narrow-gauge railway once linked the town to the surrounding farms.",
             "The annual lantern procession draws visitors from across the region.",
             "Fishing and {thing} were the main trades until the last century.",
             "The town council meets in a hall decorated with painted ceiling panels.",
             "A footpath along the {river} leads to a ruined mill and a weir.",
             "The local school has taught in the same {building} for generations.",
             "Winters are long and damp, and fog settles in the valley most mornings.",
             "Several streets are named after the guilds that once worked there.",
             "The harbour wall was rebuilt after a storm damaged its western end."],
    "work": ["The piece calls for a large chorus and an unusually small string section.",
             "Its second movement quotes a folk tune about {thing}.",
             "Audiences at the first performance were reported to have stood for several minutes.",
             "The score was revised twice, and the second version is the one usually heard today.",
             "A recording made on wax cylinders is said to have been lost in a fire.",
             "The work is rarely staged because of the elaborate scenery it requires.",
             "Its libretto draws on an old story about a {building} by the {river}.",
             "Several passages were cut by the first conductor and restored much later.",
             "The manuscript is kept in a {building} and can be viewed by appointment.",
             "Critics at the time found the ending abrupt, though later listeners disagreed.",
             "A revival in a small theatre brought the piece back to wider attention.",
             "The overture is often played on its own at outdoor concerts in summer."],
}
_THINGS = ["bells", "clockwork", "river birds", "old maps", "glassware", "woodcuts", "weather", "lace", "salt"]
_BUILDINGS = ["chapel", "granary", "customs house", "watchtower", "guildhall", "boathouse"]
_RIVERS = ["Ossel", "Marrow", "Tane", "Lisk"]
_DAYS = ["Monday", "Wednesday", "Friday", "Saturday"]


def _lengthen(paragraph: list, kind: str) -> list:
    """Filler sentences until the paragraph has about as many words as a real one (a seeded draw per title, so
    every other part of the fixture stays as it was)."""
    title, sentences = paragraph
    rng = random.Random(f"filler:{title}")
    target_words = int(rng.triangular(28, 135, 95))  # ~1.3 GPT-2 tokens a word: 37-171 tokens, mean ~110
    fill = dict(first=title.split()[0], their=rng.choice(["his", "her", "their"]), thing=rng.choice(_THINGS),
                place=rng.choice(_TOWNS), river=rng.choice(_RIVERS), day=rng.choice(_DAYS),
                building=rng.choice(_BUILDINGS))
    extra = rng.sample(_FILLER[kind], len(_FILLER[kind]))
    words = sum(len(x.split()) for x in sentences)
    out = list(sentences)
    while extra and words < target_words:
        sentence = " " + extra.pop().format(**fill)
        out.append(sentence)
        words += len(sentence.split())
    return [title, out]


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
        paras[name] = _lengthen(_person_paragraph(name, job, town, country, year, rng), "person")
    for town, (country, year, river) in towns.items():
        paras[town] = _lengthen(_town_paragraph(town, country, year, river), "town")
    for work, (kind, author, year) in works.items():
        paras[work] = _lengthen(_work_paragraph(work, kind, author, year), "work")

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
