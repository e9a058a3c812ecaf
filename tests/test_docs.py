"""What the manual says of the API and the command line is what the code takes: every option of
every command is on its line of docs/command-line.md, the ``Tailor`` line of
docs/training-loops.md names every option with its default, the snippets that build a ``Tailor``
with options build a valid configuration, the merge plan of docs/merge.md is a valid plan, and
every name the pages import from llmtailor is public (tests/test_readme.py runs the examples
themselves)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import typer
import yaml
from test_readme import FENCED, PAGES, ROOT, block

import llmtailor
from llmtailor.cli import app

COMMANDS = typer.main.get_command(app).commands


def text(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_of_every_command_is_on_its_line_of_the_command_line_page(name):
    lines = [line.split("#")[0] for line in block("docs/command-line.md", "# Command line").splitlines()]
    shown = " ".join(line for line in lines if line.split()[1:2] == [name])
    assert shown, f"no line of docs/command-line.md for llmtailor {name}"
    options = [param.opts for param in COMMANDS[name].params if param.param_type_name == "option"]
    assert [opts for opts in options if not any(re.search(rf"{o}\b", shown) for o in opts)] == []


def test_the_command_line_page_names_the_global_storage_option():
    for param in typer.main.get_command(app).params:
        assert any(opt in text("docs/command-line.md") for opt in param.opts), param.opts


def documented(page: str, name: str) -> dict[str, object]:
    """``parameter: default`` of the documented signature ``name(...)`` of ``page`` (in backquotes,
    at the start of a list item), the defaults as values where they are literals."""
    match = re.search(rf"^- `({re.escape(name)}\(.*?\))( -> \w+)?`", text(page), re.M)
    assert match, f"no `{name}(...)` item in {page}"
    arguments = ast.parse(f"def {match.group(1)}: pass").body[0].args
    pairs = [*zip(arguments.args[::-1], arguments.defaults[::-1]), *zip(arguments.kwonlyargs, arguments.kw_defaults)]
    values: dict[str, object] = {}
    for argument, default in pairs:
        try:
            values[argument.arg] = ast.literal_eval(default)
        except ValueError:
            values[argument.arg] = ast.unparse(default)
    return values


def test_the_tailor_line_names_every_option_with_its_default():
    from llmtailor import TailorConfig

    shown = documented("docs/training-loops.md", "Tailor")
    expected = {name: field.default for name, field in TailorConfig.model_fields.items() if name != "policy"}
    parameters = inspect.signature(llmtailor.Tailor).parameters
    expected.update({name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty
                     and p.kind is not p.VAR_KEYWORD and name != "policy"})
    assert sorted(shown) == sorted([*expected, "policy"])
    assert {name: shown[name] for name in expected} == expected
    assert shown["policy"] == "Full()" and type(TailorConfig().policy).__name__ == "Full"


@pytest.mark.parametrize("method", ["save", "restore"])
def test_the_save_and_restore_lines_name_every_parameter_with_its_default(method):
    shown = documented("docs/training-loops.md", method)
    parameters = inspect.signature(getattr(llmtailor.Tailor, method)).parameters
    assert shown == {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def tailor_calls() -> list[tuple[str, str]]:
    """Every ``Tailor(...)`` call of the pages' Python snippets, as source text, with its page."""
    calls = []
    for page in PAGES:
        for language, code in FENCED.findall(text(page)):
            if language == "python":
                calls += [(page, ast.unparse(node)) for node in ast.walk(ast.parse(code))
                          if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Tailor"]
    return calls


class Names(dict):
    """A snippet's names: llmtailor's public ones, ``Tailor`` the one given; the reader's own
    (``model``, ``engine``, ...) None."""

    def __missing__(self, name: str) -> object:
        return getattr(llmtailor, name) if name in llmtailor.__all__ else None


@pytest.mark.parametrize("page, call", tailor_calls())
def test_every_tailor_the_pages_build_takes_those_options(page, call):
    """Each ``Tailor(...)`` of the pages with its options checked as a Tailor checks them: a
    misspelt option, a removed one or a bad value (a Tier's) fails here."""
    from llmtailor import TailorConfig

    def checked(run_dir, model, optimizer=None, lr_scheduler=None, policy=None, *, stateful=None, **options):
        return TailorConfig(**({"policy": policy} if policy is not None else {}), **options)

    assert isinstance(eval(call, {}, Names(Tailor=checked)), TailorConfig)


def test_the_merge_plan_of_the_merge_page_is_a_valid_plan():
    from llmtailor.merge.plan import PlanSpec

    plan = PlanSpec.model_validate(yaml.safe_load(block("docs/merge.md", "## Compose checkpoints with a merge plan", "yaml")))
    assert [s.sources[0].layer_range for s in plan.slices] == [(0, 24), (8, 32)]


def test_every_name_the_pages_import_from_llmtailor_is_public():
    imported = set()
    for page in PAGES:
        for language, code in FENCED.findall(text(page)):
            if language != "python":
                continue
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.ImportFrom) and node.module == "llmtailor":
                    imported.update(alias.name for alias in node.names)
    assert imported and sorted(imported - set(llmtailor.__all__)) == []
    assert all(getattr(llmtailor, name) is not None for name in llmtailor.__all__)


def test_every_option_of_the_trainer_integration_is_on_its_page():
    """``TailorTrainer``'s own options (read from its source: importing transformers is slow)."""
    source = ast.parse((ROOT / "llmtailor/integrations/hf.py").read_text(encoding="utf-8"))
    init = next(node for node in ast.walk(source) if isinstance(node, ast.ClassDef) and node.name == "TailorTrainer")
    init = next(node for node in init.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    options = [a.arg for a in init.args.kwonlyargs if a.arg.startswith("tailor_")]
    page = text("docs/integrations.md")
    assert len(options) > 3 and [name for name in options if not re.search(rf"\b{name}\b", page)] == []
