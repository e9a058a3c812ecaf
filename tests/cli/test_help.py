"""``llmtailor --help`` and every command's ``--help`` read well at 80 and 100 columns: the
descriptions (from the commands' docstrings) reflow to the terminal, in the command list and in
each command's own help; a docstring's hard line break never ends a printed line early, no word
is lost (to rich markup or a cut), no line is wider than the terminal, no cell is cut to ``…``."""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.testing import CliRunner

from llmtailor.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)


def invoke(args: list[str], columns: int) -> list[str]:
    result = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= columns, max(lines, key=len)
    assert "…" not in result.output
    return lines


def words(docstring: str) -> list[str]:
    return inspect.cleandoc(docstring).split()


def check_filled(lines: list[str], width: int) -> None:
    """``lines`` are one paragraph wrapped greedily: each line ends where the next line's first
    word would not have fitted in ``width`` (the widest line of the block stands for the width
    the text was wrapped to, which is no narrower). A line a hard line break ended has room."""
    for line, following in zip(lines, lines[1:]):
        assert len(line) + 1 + len(following.split()[0]) > width, f"ended early:\n{line}\n{following}"


def command_rows(lines: list[str]) -> dict[str, list[str]]:
    """The description lines of each command in the Commands panel, by command name."""
    start = next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    inner = [line.rstrip()[1:-1] for line in lines[start + 1:end]]
    column = len(inner[0]) - len(inner[0].lstrip()) + len(inner[0].split()[0])
    column += len(inner[0][column:]) - len(inner[0][column:].lstrip())  # where descriptions start
    rows: dict[str, list[str]] = {}
    for row in inner:
        name, description = row[:column].strip(), row[column:].strip()
        if name:
            rows[name] = []
        rows[list(rows)[-1]].append(description)
    return rows


def description(lines: list[str]) -> list[list[str]]:
    """The paragraphs of a command's own help: between its Usage line and its first panel."""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Usage:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    paragraphs: list[list[str]] = [[]]
    for line in lines[start + 1:end]:
        if line.strip():
            paragraphs[-1].append(line.strip())
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p]


@pytest.mark.parametrize("columns", [80, 100])
def test_the_command_list_reflows_each_commands_summary(columns):
    rows = command_rows(invoke(["--help"], columns))
    assert sorted(rows) == COMMANDS
    width = max(len(line) for lines in rows.values() for line in lines)
    for name, lines in rows.items():
        summary = inspect.cleandoc(typer.main.get_command(app).commands[name].callback.__doc__).split("\n\n")[0]
        assert " ".join(lines).split() == summary.split(), name
        check_filled(lines, width)


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("name", COMMANDS)
def test_each_commands_help_reflows_its_whole_docstring(name, columns):
    paragraphs = description(invoke([name, "--help"], columns))
    docstring = typer.main.get_command(app).commands[name].callback.__doc__
    assert [word for p in paragraphs for word in " ".join(p).split()] == words(docstring)
    assert len(paragraphs) == len(inspect.cleandoc(docstring).split("\n\n"))
    width = max(len(line) for lines in paragraphs for line in lines)
    for lines in paragraphs:
        check_filled(lines, width)


def test_reflow_joins_the_lines_of_each_paragraph_and_keeps_a_preformatted_one():
    from llmtailor.cli import reflow

    text = """First line
        goes on.

        Second paragraph,
        two lines.

        \b
        kept
        as is"""
    assert reflow(text) == "First line goes on.\n\nSecond paragraph, two lines.\n\n\b\nkept\nas is"
