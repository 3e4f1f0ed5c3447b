"""Finding and rendering Jinja prompt templates. Templates are text only; nothing is declared in Python.

A template may declare settings the scorer needs with a top-level constant, e.g.
``{% set answer_phrase = "The answer is:" %}``: the engine reads it (``PromptTemplate.declared``) so a user
template with its own answer phrase is scored by it without touching Python."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

import jinja2

from evals.base import ToolSpec, read_utf8
from harness.hashing import digest

PROMPTS_DIR = Path(str(importlib.resources.files("prompts")))  # the installed package's templates


class TemplateError(ValueError):
    """A template is missing, does not parse, or uses a variable the task does not provide."""


def available_templates() -> list[str]:
    """The bundled templates a run can name; ``_name.j2`` files are parts other templates include."""
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.j2") if not p.name.startswith("_"))


def resolve_template(name_or_path: str) -> Path:
    """A bare name (no ``/``, no ``.j2``) is a bundled template (``hotpotqa_cot`` → prompts/hotpotqa_cot.j2),
    whatever files or folders of that name the working directory holds; anything else is a file path."""
    p = Path(name_or_path).expanduser()
    bare = "/" not in name_or_path and p.suffix != ".j2"
    cand = PROMPTS_DIR / f"{name_or_path}.j2"
    if bare and cand.is_file():
        return cand
    if p.is_file():
        return p.resolve()
    if bare:
        raise TemplateError(f"unknown template {name_or_path!r}; bundled templates: "
                            f"{', '.join(available_templates())} (or pass a path to a .j2 file)")
    raise TemplateError(f"template file {str(p)!r} not found")


def _raise(message: str):
    raise TemplateError(message)


class PromptTemplate:
    """A compiled template with StrictUndefined, so a missing variable is an error and never an empty string.

    Templates run in Jinja's immutable sandbox: a template file is data someone handed over, and an ordinary
    Environment lets it reach Python (``cycler.__init__.__globals__.os``). ``{% include "NAME.j2" %}`` finds a
    sibling of the template first, then a bundled one; the template's hash covers every file it includes."""

    def __init__(self, name_or_path: str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.path = resolve_template(name_or_path)
        self.source = _read(self.path)
        loader = jinja2.FileSystemLoader([str(self.path.parent), str(PROMPTS_DIR)])
        env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False,
                                            autoescape=False, loader=loader)
        env.globals["raise_exception"] = _raise  # the name Hugging Face chat templates use for the same job
        self._env = env
        try:
            self._template = env.from_string(self.source)
            parsed = env.parse(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"template {self.path} does not parse: line {e.lineno}: {e.message}") from e
        self.variables: set[str] = set()  # what the template and its includes read (filled by _sources)
        self.includes: list[str] = []  # the templates it includes, imports or extends, recursively
        self.sha256 = digest(self._sources(parsed), length=16)
        self._declared = {n.target.name: n.node.value for n in parsed.body
                          if isinstance(n, jinja2.nodes.Assign) and isinstance(n.target, jinja2.nodes.Name)
                          and isinstance(n.node, jinja2.nodes.Const)}

    def _sources(self, parsed, seen: frozenset = frozenset()) -> str:
        """This template's text and, recursively, that of every template it includes, imports or extends."""
        from jinja2 import meta

        text = self.source if not seen else ""
        self.variables |= meta.find_undeclared_variables(parsed)
        for name in meta.find_referenced_templates(parsed):
            if name is None:
                raise TemplateError(f"template {self.path} includes a template by a computed name; name included "
                                    "templates literally ({% include \"NAME.j2\" %}) so the run's hash covers them")
            if name in seen:
                continue
            self.includes.append(name)
            try:
                src, file, _ = self._env.loader.get_source(self._env, name)
            except jinja2.TemplateNotFound:
                raise TemplateError(f"template {self.path} includes {name!r}, which is neither beside it "
                                    f"({self.path.parent}) nor a bundled template ({PROMPTS_DIR})") from None
            try:
                sub = self._env.parse(src)
            except jinja2.TemplateSyntaxError as e:
                raise TemplateError(f"template {file} (included by {self.path}) does not parse: line {e.lineno}: "
                                    f"{e.message}") from e
            text += f"\0{name}\0{src}" + self._sources(sub, seen | {name})
        return text

    def declared(self, name: str, default=None):
        """A constant the template sets at top level (``{% set name = "..." %}``), or ``default``."""
        return self._declared.get(name, default)

    @property
    def name(self) -> str:
        return self.path.stem

    def render(self, **variables) -> str:
        """``tool`` defaults to the retrieval tool's syntax (evals.base.ToolSpec), disabled."""
        from jinja2.exceptions import SecurityError

        if "tool" not in variables:
            variables["tool"] = ToolSpec().template_vars()
        try:
            return self._template.render(**variables)
        except jinja2.UndefinedError as e:
            raise TemplateError(f"template {self.path} uses an undefined variable ({e.message}); the task "
                                f"provides: {', '.join(sorted(variables))}") from e
        except SecurityError as e:
            raise TemplateError(f"template {self.path} tried something templates may not do ({e}); templates "
                                "run sandboxed and hold text, not code") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"template {self.path} failed to render: {e}") from None


def _read(path: Path) -> str:
    return read_utf8(path, "template", TemplateError)
