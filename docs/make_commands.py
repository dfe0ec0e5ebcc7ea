"""Write the list of ``maxent-arrow`` commands in ``docs/architecture.md`` from the command
table (``maxent_arrow.cli.COMMANDS``), between its ``<!-- commands -->`` and
``<!-- /commands -->`` markers. ``tests/cli/test_commands.py`` checks that the document holds
what this writes::

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
REGION = re.compile(r"(<!-- commands -->\n).*?(<!-- /commands -->)", re.DOTALL)


def command_list() -> str:
    """One Markdown item per command, in the table's order: its synopsis and summary."""
    return "".join(
        f"- `maxent-arrow {c.synopsis()}`: {c.summary}"
        + (" (writes the store)" if c.writes else "")
        + "\n"
        for c in cli.COMMANDS
    )


def with_commands(text: str) -> str:
    """``text`` (the document) with its marked region holding the generated list."""
    if len(REGION.findall(text)) != 1:
        raise SystemExit(f"{ARCHITECTURE}: expected one <!-- commands --> region")
    return REGION.sub(lambda m: m.group(1) + command_list() + m.group(2), text)


if __name__ == "__main__":
    ARCHITECTURE.write_text(
        with_commands(ARCHITECTURE.read_text(encoding="utf-8")), encoding="utf-8"
    )
    print(f"wrote the command list of {ARCHITECTURE}")
