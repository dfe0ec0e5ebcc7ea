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
    assert len(found["Record a verl run"]) == 1  # after "Use with verl", in its namespace


@pytest.mark.slow
@pytest.mark.parametrize("title", ["Use with TRL", "Use with verl"])
def test_the_snippets_run(title, tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl" if "TRL" in title else "verl")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs"}
    # "Record a verl run" continues "Use with verl" (its batch is that section's).
    titles = [title] if "TRL" in title else [title, "Record a verl run"]
    for section in titles:
        for i, block in enumerate(sections()[section]):
            where = f"docs/integrations.md {section} block {i}"
            exec(compile(block, where, "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    if "TRL" in title:
        assert "completion_ids" in printed and "dapo" in printed
        assert "'ds_source': 'even'" in printed and "'trl_step': 1" in printed
    else:
        assert "'num_completions': 2" in printed
        assert "[{'step': 10, 'policy_version': 9}]" in printed
