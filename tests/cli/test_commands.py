"""The command table, ``maxent_arrow.cli.COMMANDS``: the parser, ``maxent-arrow --help``, the
module docstring and ``docs/architecture.md`` list exactly its commands, in its order, and
what a row says of its command (it writes the store, it prints JSON) is what the command does."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from maxent_arrow import cli
from maxent_arrow.cli import COMMANDS, EXIT_OK, EXIT_USAGE, main
from maxent_arrow.testing import write_store

ROOT = Path(__file__).resolve().parents[2]
NAMES = [c.name for c in COMMANDS]
PARSED = [c for c in COMMANDS if c.arguments is not None]  # all but demo, which forwards


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_holds_the_documented_commands_once_each():
    # DESIGN.md §3's list: a command leaves the CLI only with a deprecation path.
    assert NAMES == [
        "demo",
        "train",
        "inspect",
        "query",
        "report",
        "offpolicy",
        "verify",
        "repair",
        "compact",
        "checkpoint",
        "upgrade",
        "files",
        "tail",
        "export",
        "view",
    ]
    for c in COMMANDS:
        assert c.summary.strip() == c.summary and "\n" not in c.summary, c.name
        assert c.summary and not c.summary.endswith("."), c.name
    assert [c.name for c in COMMANDS if c.writes] == ["repair", "compact", "checkpoint", "upgrade"]


def test_a_synopsis_is_the_command_and_what_it_must_be_given():
    synopsis = {c.name: c.synopsis() for c in COMMANDS}
    assert synopsis["demo"] == "demo [...]"
    assert synopsis["inspect"] == "inspect RUN"
    assert synopsis["query"] == "query RUN SQL"
    assert synopsis["export"] == "export RUN --to ipc|hf DIR"
    assert synopsis["train"] == "train --from-store RUN --out OUT"


def test_the_module_docstring_lists_the_table():
    doc = cli.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0] + "\n"
    assert block == cli.command_list(), "paste cli.command_list() into the docstring"
    lines = block.splitlines()
    assert [line.split()[0] for line in lines] == NAMES
    for line, c in zip(lines, COMMANDS):
        assert line.endswith(c.summary + (" [writes]" if c.writes else "")), line


def _make_commands():
    spec = importlib.util.spec_from_file_location(
        "make_commands", ROOT / "docs" / "make_commands.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_doc_lists_the_table():
    """``docs/architecture.md`` holds exactly the list ``docs/make_commands.py`` writes."""
    module = _make_commands()
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert module.with_commands(text) == text, "run: python docs/make_commands.py"
    block = text.split("<!-- commands -->\n", 1)[1].split("<!-- /commands -->", 1)[0]
    listed = re.findall(r"^- `maxent-arrow (\S+)", block, re.MULTILINE)
    assert listed == NAMES
    for c in COMMANDS:
        assert f"`maxent-arrow {c.synopsis()}`: {c.summary}" in block, c.name


def test_the_readme_s_table_is_the_command_table():
    """The README's table of commands is the one ``docs/make_commands.py`` writes from
    COMMANDS: every command, in its order (the hand-written one left out ``train`` and
    ``offpolicy``)."""
    module = _make_commands()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = module.command_table()
    assert module.with_commands(text, table) == text, "run: python docs/make_commands.py"
    block = text.split("<!-- commands -->\n", 1)[1].split("<!-- /commands -->", 1)[0]
    assert re.findall(r"^\| `(\S+)", block, re.MULTILINE) == NAMES


def test_the_doc_script_refuses_a_document_without_its_region():
    with pytest.raises(SystemExit, match="commands"):
        _make_commands().with_commands("# no markers here\n")


def test_help_lists_every_command_in_the_table_s_order(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == EXIT_OK
    assert re.findall(r"^    (\S+)", out, re.MULTILINE) == NAMES
    flat = " ".join(out.split())
    for c in COMMANDS:
        assert " ".join(c.help.split()) in flat, c.name


@pytest.mark.parametrize("command", PARSED, ids=lambda c: c.name)
def test_each_command_s_help_is_its_row_s(capsys, command):
    code, out, _ = run(capsys, command.name, "--help")
    assert code == EXIT_OK
    assert out.startswith(f"usage: maxent-arrow {command.name}")
    flat = " ".join(out.split())
    assert " ".join(command.help.split()) in flat
    # A command that changes the store takes its lock, and says how long it waits for it.
    assert ("--lock-timeout" in out) == command.writes
    # Every command that prints data prints it as JSON on request; view serves a page.
    assert ("--json" in out) == (command.name != "view")
    assert ("the run directory or its store" in " ".join(out.split())) == command.store


def test_demo_gets_what_follows_it_and_the_table_s_names(capsys, monkeypatch):
    calls = []

    def fake_main(argv, *, commands):
        calls.append((argv, commands))
        return 0

    monkeypatch.setattr(cli.demo, "main", fake_main)
    assert run(capsys, "demo", "--steps", "3", "--help")[0] == EXIT_OK
    assert calls == [(["--steps", "3", "--help"], tuple(NAMES))]

    def refuses(argv, *, commands):
        raise SystemExit("error: --steps: expected a number")

    monkeypatch.setattr(cli.demo, "main", refuses)
    code, out, err = run(capsys, "demo", "--steps", "x")
    assert code == EXIT_USAGE and out == ""
    assert err == "maxent-arrow demo: error: --steps: expected a number\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("commands") / "store", eval_steps=(1,), seed=7)


def _contents(root: Path) -> list[tuple[str, str]]:
    return sorted(
        (p.relative_to(root).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest())
        for p in root.rglob("*")
        if p.is_file()
    )


def test_the_commands_that_do_not_write_leave_the_store_as_it_was(capsys, store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store.root, copy)
    before = _contents(copy)
    argv = {
        "inspect": [],
        "query": ["SELECT count(*) FROM samples"],
        "report": ["--out", tmp_path / "report"],
        "offpolicy": [],
        "verify": [],
        "files": [],
        "tail": ["--since", "0", "--timeout", "0.1"],
        "export": ["--to", "ipc", tmp_path / "ipc"],
    }
    # Every reading command of the table but view, which serves until Ctrl-C (its own tests
    # read through its server).
    assert set(argv) == {c.name for c in PARSED if c.store and not c.writes} - {"view"}
    for name, rest in argv.items():
        code, _, err = run(capsys, name, copy, *rest)
        assert code == EXIT_OK, (name, err)
        assert _contents(copy) == before, name
