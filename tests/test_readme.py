"""Every ```python block of the README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_python_examples():
    assert python_blocks()


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i, block in enumerate(python_blocks()):
        namespace: dict = {"__name__": f"readme_block_{i}"}
        exec(compile(block, f"README.md block {i}", "exec"), namespace)  # noqa: S102
