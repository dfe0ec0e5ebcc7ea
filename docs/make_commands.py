"""Write the lists of ``maxent-arrow`` commands from the command table
(``maxent_arrow.cli.COMMANDS``), between the ``<!-- commands -->`` and ``<!-- /commands -->``
markers of ``docs/architecture.md`` (a list) and of ``README.md`` (a table).
``tests/cli/test_commands.py`` checks that both hold what this writes::

    python docs/make_commands.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from maxent_arrow import cli  # noqa: E402

ARCHITECTURE = HERE / "architecture.md"
README = HERE.parent / "README.md"
REGION = re.compile(r"(<!-- commands -->\n).*?(<!-- /commands -->)", re.DOTALL)


def command_list() -> str:
    """One Markdown item per command, in the table's order: its synopsis and summary."""
    return "".join(
        f"- `maxent-arrow {c.synopsis()}`: {c.summary}"
        + (" (writes the store)" if c.writes else "")
        + "\n"
        for c in cli.COMMANDS
    )


def command_table() -> str:
    """The README's table: one row per command, in the table's order (every command: the
    README's own table once left out ``train`` and ``offpolicy``)."""
    rows = ["| command | what it does |", "|---|---|"]
    for c in cli.COMMANDS:
        synopsis = c.synopsis().replace("|", "\\|")
        rows.append(f"| `{synopsis}` | {c.summary}{' (writes the store)' if c.writes else ''} |")
    return "".join(row + "\n" for row in rows)


def with_commands(text: str, listing: str | None = None) -> str:
    """``text`` (a document) with its marked region holding ``listing`` (default: the list of
    ``docs/architecture.md``)."""
    if len(REGION.findall(text)) != 1:
        raise SystemExit("expected one <!-- commands --> region in the document")
    listing = command_list() if listing is None else listing
    return REGION.sub(lambda m: m.group(1) + listing + m.group(2), text)


if __name__ == "__main__":
    for path, listing in ((ARCHITECTURE, command_list()), (README, command_table())):
        path.write_text(with_commands(path.read_text(encoding="utf-8"), listing), encoding="utf-8")
        print(f"wrote the commands of {path}")
