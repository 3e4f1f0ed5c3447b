"""The docs cannot rot. Every fenced command in README.md and docs/ names a program that exists and only flags
that program takes (its real ``--help``, run once per program), task options its task declares, and extras
pyproject.toml defines; every block marked ``run`` (```` ```bash run ````) runs, offline, on tiny models, in a
fresh folder; every relative link points at a file; the README stays a short front page listing every page."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import pytest
import tomllib

from evals import task_class, task_names

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    info: str  # the fence's info string: "bash", "bash run", "python", ...
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out, lines, i = [], page.read_text().split("\n"), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info, body = i + 1, lines[i][3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(Block(page, start, info, "\n".join(body)))
        i += 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]
SHELL = [b for b in ALL if b.info.split()[:1] == ["bash"]]
RUNNABLE = [b for b in SHELL if "run" in b.info.split()[1:]]


def commands(code: str) -> list[list[str]]:
    """Each command of a shell block as argv (continuations joined, comments and environment assignments
    dropped, ``A && B`` split)."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", ";", "|"):
                while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def program(argv: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """The program a command runs (as the argv that runs it from the repository root) and its arguments; None
    for commands that are not this project's (ls, ``python -c``)."""
    if argv[:2] == ["accelerate", "launch"]:
        argv = ["python", *argv[2:]]
    if argv[:2] == ["bash", "scripts/with-vllm-cpu.sh"]:  # the same program, in vLLM's CPU environment
        argv = argv[2:]
    if argv[0] != "python" or len(argv) < 2:
        return None
    if argv[1] == "-m":
        return ("-m", argv[2]), argv[3:]
    if argv[1].endswith(".py"):
        return (argv[1],), argv[2:]
    return None


# Every program's --help in one child process (one interpreter start and one torch import for all of them; a
# program's side effects stay in the child): {program: (exit status, text)}.
HELP_CHILD = """
import contextlib, io, json, runpy, sys
out = {}
for prog in json.loads(sys.argv[1]):
    buf, code = io.StringIO(), None
    extra = ["run"] if prog == ["-m", "harness.lm_eval"] else []  # lm-eval's flags are its run command's
    sys.argv = [prog[-1], *extra, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            if prog[0] == "-m":
                runpy.run_module(prog[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(prog[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    out[" ".join(prog)] = [code, buf.getvalue()]
print("HELP " + json.dumps(out))
"""


@lru_cache(maxsize=None)
def _help_texts(progs: tuple[tuple[str, ...], ...]) -> dict[str, tuple[int, str]]:
    res = subprocess.run([sys.executable, "-c", HELP_CHILD, json.dumps([list(p) for p in progs])], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "HELP " in res.stdout, res.stderr[-3000:]
    return json.loads(res.stdout.split("HELP ", 1)[1])


def documented_programs() -> tuple[tuple[str, ...], ...]:
    found = {f[0] for block in SHELL for argv in commands(block.code) if (f := program(argv))
             if f[0][0] == "-m" or (ROOT / f[0][0]).is_file()}
    return tuple(sorted(found | {("-m", "harness.report")}))


def help_text(prog: tuple[str, ...]) -> str:
    code, text = _help_texts(documented_programs())[" ".join(prog)]
    assert code in (0, None), f"{' '.join(prog)} --help failed ({code}):\n{text[-2000:]}"
    return text


def _task_options(args: list[str]) -> list[str]:
    """Problems with ``--task`` and ``--task-arg KEY=VALUE`` in one command's arguments."""
    task = args[args.index("--task") + 1] if "--task" in args else None
    bad = []
    if task is not None and task not in task_names():
        return [f"--task {task}: no such task ({', '.join(task_names())})"]
    keys = [a.split("=", 1)[0] for i, a in enumerate(args) if i and args[i - 1] in ("--task-arg", "--task_arg")]
    if task is not None:
        known = {f.name for f in fields(task_class(task).Options)}
        bad += [f"--task-arg {k}: task {task} has no such option ({', '.join(sorted(known))})"
                for k in keys if k not in known]
    return bad


def test_the_docs_hold_commands_and_runnable_blocks():
    """What the other tests check is there: a marker that went missing would make them pass on nothing."""
    assert len(SHELL) >= 15 and len(RUNNABLE) >= 5, (len(SHELL), len(RUNNABLE))
    assert {b.page.name for b in RUNNABLE} >= {"README.md", "evaluation.md", "run-directories.md", "trainer.md"}


@pytest.mark.slow
def test_every_documented_command_uses_flags_its_program_takes():
    problems = []
    for block in SHELL:
        for argv in commands(block.code):
            if argv[0] == "pip":
                extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
                for spec in argv:
                    m = re.fullmatch(r"(?:\.|icr-harness)\[([\w,-]+)\]", spec.strip("'\""))
                    problems += [f"{block.name}: pip extra [{e}] is not in pyproject.toml" for e in
                                 (m.group(1).split(",") if m else []) if e not in extras]
                continue
            found = program(argv)
            if found is None:
                continue
            prog, args = found
            if prog[0] != "-m" and not (ROOT / prog[0]).is_file():
                problems.append(f"{block.name}: {prog[0]} does not exist")
                continue
            text = help_text(prog)
            for flag in {a.split("=", 1)[0] for a in args if a.startswith("--")}:
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    problems.append(f"{block.name}: {' '.join(prog)} has no flag {flag}")
            if prog[-1] in ("harness.eval", "harness.train"):
                problems += [f"{block.name}: {p}" for p in _task_options(args)]
    assert not problems, "\n".join(problems)


def test_the_flag_check_sees_a_flag_that_does_not_exist():
    text = help_text(("-m", "harness.report"))
    assert re.search(r"(?<![\w-])--official-gold(?![\w-])", text)
    assert not re.search(r"(?<![\w-])--official(?![\w-])", text)  # a prefix of a real flag is not a flag
    assert _task_options(["--task", "mqar", "--task-arg", "pairs=4", "--task-arg", "pears=4"]) == [
        "--task-arg pears: task mqar has no such option (eval_seed, format, keys, length, pairs, queries, "
        "samples, shots, values)"]


def plain_commands(code: str) -> list[list[str]] | None:
    """The block's commands as argv where it is nothing but commands, one a line (continuations joined, comments
    dropped); None where it uses any other shell syntax (its commands then run through bash)."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        if any(re.search(r"[|&;<>$`*?(){}\[\]~]", w) for w in words) or \
                (words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
            return None
        if words:
            out.append(words)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_runnable_block_runs(block, tmp_path, warm_python):
    """The block as a user pastes it, from an empty folder, offline (tiny models are built, never fetched): its
    commands in turn, stopping at the first that fails, as ``set -e`` does. Where the block is plain commands,
    each ``python`` is a process forked from the warm interpreter (tests/helpers.py: the same program, without a
    fresh interpreter's ~6 CPU-seconds of imports) and the others run as they are; else the block runs in bash."""
    # the worker's thread count (one under parallel workers: see conftest.py), not more; offline
    env = warm_python.env
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONPATH"] == str(ROOT)
    argvs = plain_commands(block.code)
    if argvs is None:
        script = tmp_path / "block.sh"
        script.write_text("set -euo pipefail\n" + block.code + "\n")
        argvs = [["bash", str(script)]]
    for argv in argvs:
        if argv[0] == "python":
            res = warm_python.run(argv[1:], env=env, cwd=tmp_path, timeout=900)
        else:
            res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"{block.name}: {shlex.join(argv)} failed ({res.returncode}):\n" \
                                    f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        assert "error:" not in res.stderr


def test_a_block_of_plain_commands_is_split_and_any_other_shell_syntax_goes_to_bash():
    assert plain_commands("python -m harness.tiny --arch phi \\\n    --out runs/x  # built offline\nls runs/x\n") == [
        ["python", "-m", "harness.tiny", "--arch", "phi", "--out", "runs/x"], ["ls", "runs/x"]]
    for shell in ("a && b", "a | b", "A=1 python x.py", "cat x > y", "echo $HOME", "ls runs/*", "(cd x)"):
        assert plain_commands(shell) is None, shell
    assert all(plain_commands(b.code) is not None for b in RUNNABLE)  # today's blocks all take the warm path


def test_python_blocks_are_python():
    for block in (b for b in ALL if b.info.split()[:1] == ["python"]):
        ast.parse(block.code, filename=block.name)


def test_relative_links_point_at_files():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_short_front_page_listing_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 300
    assert readme.index("pip install torch==2.13.0 && pip install -e . && python -m harness.demo") < 600
    assert "pip install torch==2.13.0 && pip install -e \".[dev]\" && bash scripts/test.sh" in readme
    listed = set(re.findall(r"\]\((docs/[^)]+\.md)\)", readme))
    pages = {str(p.relative_to(ROOT)) for p in PAGES if p.parent.name == "docs"}
    assert pages <= listed, f"pages the README's contents do not list: {sorted(pages - listed)}"
    for page in PAGES[1:]:  # each page opens with its title and one paragraph of what it covers
        head = page.read_text().split("\n\n")
        assert head[0].startswith("# ") and not head[1].startswith(("#", "```", "|")), page


def test_ci_runs_the_readme_test_command():
    """.ci/run is the README's test command, step for step (pip's -q and ``python -m pip`` aside)."""
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith('pip install torch==2.13.0 && pip install -e ".[dev]"'))
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert [c.replace("python -m pip", "pip").replace(" -q ", " ", 1) if c.startswith("python -m pip") else c
            for c in ci] == [part.strip() for part in command.split("&&")]
