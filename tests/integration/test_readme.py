"""The README's quickstart runs as written: every ```python block, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_a_quickstart_for_each_use():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    for use in ("Trainer ingestion", "Offline replay", "Analytics"):
        assert f"**{use}**" in text
    assert len(python_blocks()) == 4


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        exec(compile(block, f"README.md block {i}", "exec"), namespace)  # noqa: S102
    assert namespace["padded"].dtype.is_floating_point is False
    assert set(namespace["curve"].column("step").to_pylist()) == {0, 1}
