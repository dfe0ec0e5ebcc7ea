"""docs/integrations.md runs as written: each section's ```python blocks, in order, in one
namespace per section (the README's "Use with TRL" and "Use with verl" are these)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def sections() -> dict[str, list[str]]:
    text = DOC.read_text(encoding="utf-8")
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title = part.splitlines()[0].strip()
        out[title] = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return out


def test_there_is_a_snippet_for_each_trainer():
    found = sections()
    assert len(found["Use with TRL"]) == 1 and len(found["Use with verl"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("title", ["Use with TRL", "Use with verl"])
def test_the_snippets_run(title, tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl" if "TRL" in title else "verl")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs"}
    for i, block in enumerate(sections()[title]):
        exec(compile(block, f"docs/integrations.md {title} block {i}", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    if "TRL" in title:
        assert "completion_ids" in printed and "dapo" in printed
    else:
        assert "'num_completions': 2" in printed
