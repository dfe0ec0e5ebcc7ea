"""The README runs as written and fits a screen: its first 40 lines say what the project is,
for whom, the two commands, a TRL example (run here) and a screenshot of the explorer; the
quickstart's ```python blocks run, in order, in one namespace; the sampler block and every
path a command is given (``runs/demo/latest``, ``runs/trl``) work on the runs the README's
own commands make; every relative link of the README and of ``docs/`` resolves. (The long
TRL and verl examples are docs/integrations.md's, which tests/integrations/test_docs.py runs.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from maxent_arrow import cli, demo
from maxent_arrow.store import RolloutStore

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FIRST_HOUR = ("<!-- first-hour:start -->", "<!-- first-hour:end -->")  # readme_timings.py's


def sections(path: Path) -> dict[str, list[str]]:
    """The ```python blocks of each ``## `` section."""
    text = path.read_text(encoding="utf-8")
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        out[part.splitlines()[0].strip()] = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return out


def run_blocks(blocks: list[str], where: str, namespace: dict | None = None) -> dict:
    namespace = {"__name__": "readme"} if namespace is None else namespace
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md {where} block {i}", "exec"), namespace)  # noqa: S102
    return namespace


def test_readme_has_a_quickstart_for_each_use():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    for use in ("Trainer ingestion", "Offline replay", "Analytics"):
        assert f"**{use}**" in text
    assert len(sections(README)["Quickstart"]) == 4


def test_the_readme_fits_a_screen():
    """It was 64 KB, with 53 lines over 300 characters and a 60-row benchmark table before
    the explorer, and its first screen named neither TRL nor verl nor the explorer."""
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 20_000
    first = "\n".join(text.splitlines()[:40])
    for word in ("TRL", "verl", "MaxEnt-GRPO", "explorer", "make demo", "make test"):
        assert word in first, word
    assert re.search(r"!\[[^]]+\]\(docs/images/explorer_\w+\.png\)", first)
    trl = re.search(r"```python\n(.*?)```", first, flags=re.S)
    assert trl is not None and "RecordingGRPOTrainer" in trl.group(1)
    assert len(trl.group(1).splitlines()) <= 16
    generated = text.index(FIRST_HOUR[0]), text.index(FIRST_HOUR[1])
    outside = text[: generated[0]] + text[generated[1] :]
    assert max(map(len, outside.splitlines())) <= 120
    assert "bench:start" not in text and "(docs/benchmarks.md)" in text


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    broken = []
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            file = target.split("#", 1)[0]
            if file and not re.match(r"[a-z]+:", file) and not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(sections(README)["Quickstart"], "Quickstart")
    assert namespace["padded"].dtype.is_floating_point is False
    assert set(namespace["curve"].column("step").to_pylist()) == {0, 1}


def _named_paths(text: str) -> set[str]:
    """The runs the README hands to a command or a store: ``maxent-arrow CMD runs/...`` and
    ``Store("runs/...")``."""
    paths = set(re.findall(r"maxent-arrow \w+ (runs/[\w/.-]+)", text))
    return paths | set(re.findall(r"Store\(\"(runs/[\w/.-]+)\"", text))


@pytest.mark.slow
def test_the_readme_s_runs_are_where_it_says(tmp_path, monkeypatch, capsys):
    """The TRL block and a demo run (its default directory, as `make demo` makes it) in one
    directory; then the sampler block runs, and every path the README names is a run that
    `inspect` reads (it named runs/demo/store, which no demo writes)."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = README.read_text(encoding="utf-8")
    blocks = sections(README)
    run_blocks(blocks["Record a TRL run"], "Record a TRL run")
    assert RolloutStore("runs/trl/store").steps() == [0, 1]
    # Enough steps that some lie within the block's staleness window (4 of version 10).
    tiny = ["--steps", "8", "--prompts", "8", "--k", "4", "--sft-steps", "300"]
    assert demo.main([*tiny, "--eval-prompts", "0", "--no-report", "--quiet"]) == 0
    assert Path("runs/demo/latest").resolve() == (tmp_path / "runs/demo/run-001").resolve()
    namespace = run_blocks(blocks["Train from the store"], "Train from the store")
    assert namespace["batch"].num_groups > 0 and namespace["state"]["batches"] == 1
    named = _named_paths(text)
    assert {"runs/demo/latest", "runs/demo/latest/store", "runs/trl"} <= named
    capsys.readouterr()
    for path in sorted(named):
        assert cli.main(["inspect", path, "--json"]) == 0, capsys.readouterr().err
