"""The README runs as written: the quickstart's ```python blocks, in order, in one namespace;
the "Use with TRL" and "Use with verl" blocks are docs/integrations.md's, which
tests/integrations/test_docs.py runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INTEGRATIONS = ROOT / "docs" / "integrations.md"


def sections(path: Path) -> dict[str, list[str]]:
    """The ```python blocks of each ``## `` section."""
    text = path.read_text(encoding="utf-8")
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        out[part.splitlines()[0].strip()] = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return out


def test_readme_has_a_quickstart_for_each_use():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    for use in ("Trainer ingestion", "Offline replay", "Analytics"):
        assert f"**{use}**" in text
    assert len(sections(README)["Quickstart"]) == 4


def test_readme_integration_snippets_are_the_tested_ones():
    readme, docs = sections(README), sections(INTEGRATIONS)
    for title in ("Use with TRL", "Use with verl"):
        assert readme[title] == docs[title] and len(readme[title]) == 1, title


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(sections(README)["Quickstart"]):
        exec(compile(block, f"README.md block {i}", "exec"), namespace)  # noqa: S102
    assert namespace["padded"].dtype.is_floating_point is False
    assert set(namespace["curve"].column("step").to_pylist()) == {0, 1}
