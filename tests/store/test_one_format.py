"""One format seam: no caller outside the store's history layer learns which catalog it holds
(counted from the source: no ``isinstance`` on a catalog class, no ``log is None``, no flag
standing in for them), and the write side commits through one protocol."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "maxent_arrow"
HISTORY = PACKAGE / "store" / "history"
CATALOGS = {"Catalog", "LogCatalog", "ListingCatalog"}


def _outside_history() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if HISTORY not in p.parents]


def _format_tests(path: Path) -> list[str]:
    """The places in ``path`` that ask which catalog (or format) a store has."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            if len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & CATALOGS:
                    found.append(f"{path.name}:{node.lineno}: isinstance on a catalog")
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = node.left, node.comparators[0]
            if isinstance(node.ops[0], ast.Is | ast.IsNot) and _is_none(right):
                name = left.attr if isinstance(left, ast.Attribute) else getattr(left, "id", "")
                if name in ("log", "catalog_log"):
                    found.append(f"{path.name}:{node.lineno}: `log is None`")
        if isinstance(node, ast.Attribute) and node.attr in (
            "reads_step_files", "has_log", "is_logged", "legacy_format"
        ):  # fmt: skip
            found.append(f"{path.name}:{node.lineno}: a flag standing in for the format")
        if isinstance(node, ast.Name) and node.id in ("has_log", "LogCatalog", "ListingCatalog"):
            if path.name != "formats.py":
                found.append(f"{path.name}:{node.lineno}: names {node.id}")
    return found


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def test_no_caller_outside_the_history_layer_asks_which_catalog_it_holds():
    found = [hit for path in _outside_history() for hit in _format_tests(path)]
    assert found == [], "\n".join(found)


def test_the_count_sees_each_form(tmp_path):
    """The check finds each form it forbids (so an empty answer means something)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "if isinstance(catalog, LogCatalog): pass\n"
        "if self.log is None: pass\n"
        "if catalog.reads_step_files: pass\n"
        "from maxent_arrow.store.history.formats import has_log\n"
        "has_log(manifest)\n"
    )
    hits = _format_tests(sample)
    assert len(hits) == 5
    assert any("isinstance" in h for h in hits) and any("`log" in h for h in hits)


def test_one_commit_protocol():
    """The commit of a unit is written once: commit_unit, through the log; nothing else in
    the package publishes a step file, and no write path takes a catalog's log directly."""
    writers = []
    for path in _outside_history():
        text = path.read_text(encoding="utf-8")
        if re.search(r"\bdef commit_unit\b", text):
            writers.append(path.relative_to(PACKAGE).as_posix())
        reaches = re.search(r"catalog\.log\b", text)
        assert not reaches, f"{path}: reaches past the catalog for its log"
    assert writers == ["store/io/commit.py"]
