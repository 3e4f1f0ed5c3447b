"""report.html in a real browser (Debian's headless Chromium through Selenium): the explorer's counts against
samples.jsonl, the gold paragraphs marked where the engine recorded them, a tool call and its result marked in a
generation, the paired view behind a paired difference, and sample text that holds markup shown as text, never run.
Where no browser can be had the browser tests are skipped, saying so; as root with apt-get (CI) it is installed."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.engine import run_eval
from harness.report import main as report_main
from tests.helpers import run_config

# its runs and report are built once, in one worker, with one browser (--dist loadgroup); a browser test is slow
pytestmark = [pytest.mark.xdist_group("test_html_report"), pytest.mark.slow]

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromedriver")
EVIL = '<script>window.PWNED = 1</script><img src=x onerror="window.PWNED = 2">ünïcødé ✓'


def _install_browser() -> str | None:
    """Why there is no browser here (None: there is one), after trying to install Debian's where this is root."""
    if all(Path(p).exists() for p in CHROMIUM):
        return None
    if shutil.which("apt-get") and hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0:
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
            subprocess.run(cmd, capture_output=True, timeout=900)
    if all(Path(p).exists() for p in CHROMIUM):
        return None
    return "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra has it)")
    why = _install_browser()
    if why:
        pytest.skip(why)
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1300,1800",
                "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMIUM[1]), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _scripted(phi_backend):
    """The tiny Phi steered to write the exemplars' tool calls (its random weights never would): the engine, the
    real ``re`` tool and the state machine run as in any run (tests/test_tool_protocol.py's scenarios)."""
    from evals.hotpotqa import HotpotQA
    from tests.helpers import ScriptedBackend
    from tests.helpers import tool_scenario

    scripts = {}
    for i, r in enumerate(HotpotQA(data="fixture").load()[:6]):
        gold = list(dict.fromkeys(t for t, _ in r["supporting_facts"]))
        scripts[r["question"]] = tool_scenario(i, gold[0], gold[-1], r["answer"] if i % 2 else "no idea")[0]

    def script_for(prompt: str):
        question = prompt[prompt.rfind("Question: ") + len("Question: "):].split("\n")[0]
        return scripts.get(question) if prompt.endswith("Answer:") else None
    return ScriptedBackend(phi_backend, script_for)


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_phi_dir, phi_backend):
    """Two runs on the fixture (the tiny Phi as it is, and steered to call the retrieval tool), one row's
    generation replaced by markup."""
    root = tmp_path_factory.mktemp("html")
    runs = []
    for name, retrieval, backend in (("plain", False, phi_backend), ("tool", True, _scripted(phi_backend))):
        out = root / name
        run_eval(run_config(tiny_phi_dir, out, limit=6, max_new_tokens=200 if retrieval else 32,
                            retrieval=retrieval, positions=["first", "middle", "last"]), backend=backend,
                 progress=False)
        runs.append(out)
    samples = runs[0] / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    rows[0]["generation"] = EVIL + rows[0]["generation"]
    rows[0]["prediction"] = EVIL
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_main([*map(str, runs), "--out", str(root / "rep")]) == 0
    return root / "rep" / "report.html", runs


def _open(browser, page: Path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(page.as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def _select(browser, element_id: str, text: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, element_id)).select_by_visible_text(text)


@pytest.mark.slow
def test_the_explorer_filters_opens_a_sample_and_marks_the_gold_paragraphs(browser, report, tmp_path):
    from selenium.webdriver.common.by import By

    page, runs = report
    _open(browser, page)
    rows = [json.loads(line) for d in runs for line in (d / "samples.jsonl").read_text().splitlines()]
    assert browser.find_element(By.ID, "count").text == f"{len(rows)} of {len(rows)} rows"
    wrong_last = [r for r in rows[:len(rows) // 2] if r["condition"] == "last" and r["scores"]["em"] < 1]
    _select(browser, "f-run", browser.find_elements(By.CSS_SELECTOR, "#f-run option")[1].text)  # the first run
    _select(browser, "f-cond", "last")
    _select(browser, "f-out", "wrong")
    assert browser.find_element(By.ID, "count").text.startswith(f"{len(wrong_last)} of ")
    assert len(wrong_last) > 1
    browser.save_screenshot(str(tmp_path / "explorer.png"))
    browser.find_elements(By.CSS_SELECTOR, "#rows tr")[0].click()
    card = browser.find_element(By.CSS_SELECTOR, "#detail .panel")
    row = next(r for r in wrong_last if r["key"] == card.get_attribute("data-key"))
    marks = card.find_elements(By.CSS_SELECTOR, "mark.ev-gold")
    spans = [e for e in row["evidence"] if e[2].startswith("gold")]
    assert len(marks) == len(spans) == 2
    assert [m.get_attribute("textContent") for m in marks] == [row["prompt"][s:e] for s, e, _ in spans]
    assert all("slot" in m.get_attribute("title") for m in marks)
    assert card.find_element(By.CSS_SELECTOR, ".gold").text == row["gold"]
    browser.save_screenshot(str(tmp_path / "sample.png"))


def test_a_tool_call_is_marked_and_the_paired_view_lists_discordant_pairs_first(browser, report):
    from selenium.webdriver.common.by import By

    page, runs = report
    _open(browser, page)
    called = [json.loads(line) for line in (runs[1] / "samples.jsonl").read_text().splitlines()]
    called = [r for r in called if r.get("tool_calls")]
    assert called, "no row of the retrieval run called the tool"
    _select(browser, "f-tool", "called")
    assert browser.find_element(By.ID, "count").text.startswith(f"{len(called)} of ")
    browser.find_elements(By.CSS_SELECTOR, "#rows tr")[0].click()
    card = browser.find_element(By.CSS_SELECTOR, "#detail .panel")
    row = next(r for r in called if r["key"] == card.get_attribute("data-key"))
    results = [m.get_attribute("textContent") for m in card.find_elements(By.CSS_SELECTOR, "mark.tool-result")]
    assert results and results[0] == row["tool_calls"][0]["result"]
    browser.find_element(By.ID, "compare").click()
    columns = browser.find_elements(By.CSS_SELECTOR, "#paired .column")
    assert len(columns) == 2 and all(c.find_elements(By.CSS_SELECTOR, ".panel") for c in columns)
    buttons = browser.find_elements(By.CSS_SELECTOR, "button.diff-rows")
    assert buttons
    buttons[-1].click()  # the last difference: all shared conditions between the two runs
    items = browser.find_elements(By.CSS_SELECTOR, "#pairs li")
    kinds = [i.get_attribute("class") for i in items]
    assert kinds == sorted(kinds, key=lambda k: k != "discordant") and len(items) == 18


def test_sample_text_with_markup_is_shown_as_text(browser, report):
    from selenium.webdriver.common.by import By

    page, _ = report
    _open(browser, page)
    _select(browser, "f-run", browser.find_elements(By.CSS_SELECTOR, "#f-run option")[1].text)
    browser.find_element(By.ID, "f-text").send_keys("PWNED")
    assert browser.find_element(By.ID, "count").text.startswith("1 of ")
    browser.find_elements(By.CSS_SELECTOR, "#rows tr")[0].click()
    assert browser.find_element(By.CSS_SELECTOR, "#detail .prediction").text == EVIL
    assert browser.execute_script("return window.PWNED === undefined")
    assert not browser.find_elements(By.CSS_SELECTOR, "#detail script, #detail img, #rows img")


def test_runs_of_two_tasks_keep_apart_in_the_explorer(report, tiny_phi_dir, phi_backend, tmp_path):
    """A report of a HotpotQA and an MQAR run: both label their lone run "tiny-phi"-like names; the explorer names
    each with its task and every paired difference points at runs of its own task."""
    import base64
    import gzip
    import re

    _, runs = report
    mqar = tmp_path / "mqar"
    run_eval(run_config(tiny_phi_dir, mqar, task="mqar", data=None, limit=None, max_new_tokens=8,
                        task_args={"pairs": 4, "samples": 6}), backend=phi_backend, progress=False)
    assert report_main([str(runs[0]), str(mqar), str(runs[1]), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    packed = re.search(r'<script id="data" type="application/octet-stream">(.*?)</script>', page, re.S).group(1)
    data = json.loads(gzip.decompress(base64.b64decode(packed.strip())))
    labels = [r["label"] for r in data["runs"]]
    assert len(set(labels)) == 3 and [r["task"] for r in data["runs"]] == ["hotpotqa", "mqar", "hotpotqa"]
    assert data["diffs"] and all(data["runs"][i]["task"] == "hotpotqa" for d in data["diffs"] for i in d["runs"])
    mqar_rows = [r for r in data["rows"] if r[0] == 1]
    assert len(mqar_rows) == 6  # the MQAR run's rows, each with its queried keys and values marked
    for r in mqar_rows:
        prompt = "".join(data["strings"][i] for i in r[9])
        asked = prompt[prompt.rfind("Recall: ") + 8:].split("\n")[0].split()
        assert [prompt[s:e] for s, e, _ in r[10]] == [f"{k} {v}" for k, v in zip(asked, r[6].split())]


def test_the_list_sorts_filters_by_finish_reason_and_keeps_the_view_in_the_url(browser, report):
    """A shared link opens the same view: the filters, the sort and the open row live in the URL's fragment."""
    from selenium.webdriver.common.by import By

    page, runs = report
    _open(browser, page)
    rows = [json.loads(line) for d in runs for line in (d / "samples.jsonl").read_text().splitlines()]
    reasons = {r["finish_reason"] for r in rows}
    assert len(reasons) > 1  # the filter has something to tell apart
    reason = sorted(reasons)[0]
    _select(browser, "f-fin", reason)
    assert browser.find_element(By.ID, "count").text.startswith(
        f"{sum(r['finish_reason'] == reason for r in rows)} of ")
    assert {td.text for td in browser.find_elements(By.CSS_SELECTOR, "#rows td.finish")} == {reason}
    _select(browser, "f-fin", "any")
    browser.find_element(By.CSS_SELECTOR, "#heads th[data-col='gen']").click()
    browser.find_element(By.CSS_SELECTOR, "#heads th[data-col='gen']").click()  # twice: descending
    snippets = [td.get_attribute("title") for td in browser.find_elements(By.CSS_SELECTOR, "#rows td.snippet")]
    assert len(set(snippets)) > 1 and snippets == sorted(snippets, reverse=True)
    _select(browser, "f-out", "wrong")
    browser.find_elements(By.CSS_SELECTOR, "#rows tr")[2].click()
    key = browser.find_element(By.CSS_SELECTOR, "#detail .panel").get_attribute("data-key")
    url = browser.current_url
    assert "out=1" in url and "sort=gen%3A-1" in url and "open=" in url
    count = browser.find_element(By.ID, "count").text
    browser.get("about:blank")
    _open_url(browser, url)
    assert browser.find_element(By.ID, "count").text == count
    assert browser.find_element(By.CSS_SELECTOR, "#detail .panel").get_attribute("data-key") == key
    assert browser.find_element(By.CSS_SELECTOR, "#heads th[data-col='gen']").get_attribute("data-dir") == "-1"


def test_an_opened_row_shows_its_context_at_the_evidence_with_the_gold_answer_marked(browser, report):
    from selenium.webdriver.common.by import By

    page, runs = report
    _open(browser, page)
    rows = [json.loads(line) for line in (runs[0] / "samples.jsonl").read_text().splitlines()]

    import re

    def answer_in_gold(r):  # as a whole word, as the page marks it
        return any(re.search(rf"(?<!\w){re.escape(r['gold'].lower())}(?!\w)", r["prompt"][s:e].lower())
                   for s, e, lab in r["evidence"] if lab.startswith("gold"))
    row = next(r for r in rows if len(r["gold"]) > 2 and answer_in_gold(r) and r["condition"] == "last")
    browser.find_element(By.ID, "f-text").send_keys(row["id"])
    _select(browser, "f-run", browser.find_elements(By.CSS_SELECTOR, "#f-run option")[1].text)
    _select(browser, "f-cond", "last")
    browser.find_elements(By.CSS_SELECTOR, "#rows tr")[0].click()
    card = browser.find_element(By.CSS_SELECTOR, "#detail .panel")
    assert card.get_attribute("data-key") == row["key"]
    assert card.find_element(By.TAG_NAME, "details").get_attribute("open") is not None  # the context is open ...
    pre = card.find_element(By.CSS_SELECTOR, "details pre")
    assert browser.execute_script("return arguments[0].scrollTop", pre) > 0  # ... at the evidence, far down
    answers = card.find_elements(By.CSS_SELECTOR, "mark.ev-gold mark.ev-answer")
    assert answers and all(m.get_attribute("textContent").lower() == row["gold"].lower() for m in answers)
    assert "%" in card.find_element(By.CSS_SELECTOR, ".scores").text  # a row's scores in percent, as the tables


def test_each_mcnemar_test_shows_its_2x2_and_figures_enlarge(browser, report):
    from selenium.webdriver.common.by import By

    page, _ = report
    _open(browser, page)
    assert "positive where A scores higher" in browser.find_element(By.ID, "direction").text
    diffs = browser.find_elements(By.CSS_SELECTOR, "#diffs .diff")
    with_test = [d for d in diffs if "McNemar" in d.text]
    assert with_test and all(d.find_elements(By.CSS_SELECTOR, "table.mcnemar") for d in with_test)
    for d in with_test:
        cells = [int(td.text) for td in d.find_elements(By.CSS_SELECTOR, "table.mcnemar td")]
        pairs = int(d.text.split("(paired, ")[1].split(" rows")[0])
        assert len(cells) == 4 and sum(cells) == pairs
    legend = browser.find_elements(By.CSS_SELECTOR, "p.legend")
    assert legend and "standard error" in legend[0].text
    settings = browser.find_elements(By.CSS_SELECTOR, "#runs details.settings")
    assert len(settings) == 2
    figure = browser.find_elements(By.CSS_SELECTOR, ".figures figure")[0]
    before = figure.size["width"]
    figure.click()
    assert "big" in figure.get_attribute("class") and figure.size["width"] > 1.5 * before


def _open_url(browser, url: str):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
