import pytest

from evals.hotpotqa import HotpotQA, load_rows
from harness.engine.prompting import PromptTemplate, TemplateError, available_templates


@pytest.fixture(scope="module")
def instance():
    rows = load_rows("fixture")
    return HotpotQA(distractors=3, positions=["last"]).instances(rows[:1], seed=0, pool_rows=rows)[0]


def test_default_template_renders_shots_then_context_in_order(instance):
    text = PromptTemplate("hotpotqa_cot").render(**instance.template_vars(), shots=4)
    assert text.count("So the answer is:") == 4 + 1  # four exemplars + the instruction line
    assert text.endswith(f"Question: {instance.question}\nAnswer:")
    where = [text.index(f"Paragraph: {p['title']}\n{p['text']}") for p in instance.paragraphs]
    assert where == sorted(where)  # paragraphs appear in the instance's order
    assert where[0] > text.rindex("So the answer is: Port Calder.")  # after the last exemplar


def test_shots_selects_exemplars_and_too_many_is_an_error(instance):
    t = PromptTemplate("hotpotqa_cot")
    assert t.render(**instance.template_vars(), shots=1).count("Question:") == 2
    assert t.render(**instance.template_vars(), shots=0).count("Question:") == 1
    with pytest.raises(TemplateError, match="4 exemplars; --shots 5"):
        t.render(**instance.template_vars(), shots=5)


def test_user_template_by_path(tmp_path, instance):
    p = tmp_path / "mine.j2"
    p.write_text("{% for p in paragraphs %}[{{ p.title }}] {% endfor %}Q: {{ question }}")
    text = PromptTemplate(str(p)).render(**instance.template_vars(), shots=0)
    assert text == "".join(f"[{x['title']}] " for x in instance.paragraphs) + f"Q: {instance.question}"


def test_undefined_variable_is_an_error_not_empty_text(tmp_path, instance):
    p = tmp_path / "typo.j2"
    p.write_text("{{ questoin }}")
    with pytest.raises(TemplateError, match="undefined variable.*questoin"):
        PromptTemplate(str(p)).render(**instance.template_vars(), shots=0)


def test_broken_template_names_file_and_line(tmp_path):
    p = tmp_path / "broken.j2"
    p.write_text("line one\n{% for p in paragraphs %}\nno end")
    with pytest.raises(TemplateError, match=r"broken.j2 does not parse: line \d"):
        PromptTemplate(str(p))


def test_unknown_template_lists_bundled():
    with pytest.raises(TemplateError, match="hotpotqa_cot"):
        PromptTemplate("no_such_template")
    assert "hotpotqa_cot" in available_templates()


def test_a_bare_name_is_a_bundled_template_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    """Regression: a folder or file named like a template in the working directory was taken as its path."""
    from harness.engine.prompting import PROMPTS_DIR, resolve_template

    monkeypatch.chdir(tmp_path)
    (tmp_path / "istree").mkdir()
    (tmp_path / "hotpotqa_cot").write_text("not a template")
    assert resolve_template("istree") == PROMPTS_DIR / "istree.j2"
    assert resolve_template("hotpotqa_cot") == PROMPTS_DIR / "hotpotqa_cot.j2"
    (tmp_path / "mine.j2").write_text("Q: {{ question }}")
    assert resolve_template("mine.j2") == tmp_path / "mine.j2"  # a path is a path
    (tmp_path / "own_template").write_text("Q: {{ question }}")
    assert resolve_template("own_template") == tmp_path / "own_template"  # no bundled one of that name
    with pytest.raises(TemplateError, match="bundled templates"):
        resolve_template("nope")
    with pytest.raises(TemplateError, match="not found"):
        resolve_template("dir/nope.j2")
