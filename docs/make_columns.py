"""Write the column tables of ``docs/arrow-layout.md`` from the column registry
(``maxent_arrow/arrow/registry.py``), between its ``<!-- columns:groups -->``,
``<!-- columns:steps -->`` and ``<!-- columns:trainer_metrics -->`` markers.
``tests/arrow/test_registry.py`` checks that the document holds what this writes::

    python docs/make_columns.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from maxent_arrow.arrow import registry as R  # noqa: E402

LAYOUT = HERE / "arrow-layout.md"


def with_tables(text: str) -> str:
    """``text`` (the document) with each marked region holding its generated table."""
    for table in (R.GROUP, R.STEP, R.TRAINER_METRICS):
        pattern = re.compile(
            rf"(<!-- columns:{table}[^>]*-->\n).*?(<!-- /columns:{table} -->)", re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(f"{LAYOUT}: no <!-- columns:{table} --> region")
        text = pattern.sub(lambda m: m.group(1) + R.markdown_table(table) + m.group(2), text)
    return text


if __name__ == "__main__":
    LAYOUT.write_text(with_tables(LAYOUT.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the column tables of {LAYOUT}")
