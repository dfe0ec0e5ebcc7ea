"""The rules of ``docs/architecture.md``, checked: the subpackage tree, the import contracts
(layers, no cycles, private modules: import-linter), the private-name rule, the pinned public
surface, the lazy exports, and the commands that must not import torch."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pyarrow as pa
import pytest

import maxent_arrow

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "maxent_arrow"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
    "importlinter"
]

SUBPACKAGES = [
    "analytics",
    "arrow",
    "compute",
    "demo",
    "explorer",
    "ingest",
    "integrations",
    "rollout",
    "store",
    "testing",
    "train",
    "types",
]
TOP_MODULES = ["arguments", "cli", "errors"]

PUBLIC_SURFACE = [
    "AdvantageStats",
    "ArgumentError",
    "BatchDiagnostics",
    "ComputeError",
    "GenerationBatch",
    "LayoutError",
    "LengthStats",
    "LossOutputs",
    "LossScalarBundle",
    "LostEntryError",
    "MaxentArrowError",
    "MissingExtraError",
    "PromptCacheEntry",
    "PromptCompletionBatch",
    "QDistribution",
    "QueryError",
    "Ragged",
    "ReadOnlyFormatError",
    "ReferenceLogprobs",
    "ReplayDataset",
    "RewardComputation",
    "RewardMoments",
    "RolloutBatch",
    "RolloutStore",
    "RunAnalytics",
    "RunConfig",
    "SchemaError",
    "SchemaVersionError",
    "ScoreBatch",
    "SequenceScores",
    "ShapeError",
    "StoreError",
    "ValidationContext",
    "__version__",
    "build_report",
    "build_score_batch",
    "compute_rewards",
    "recompute",
]


def _env() -> dict[str, str]:
    """The environment of a subprocess that imports this checkout's ``maxent_arrow``."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


# ---------------------------------------------------------------------------- the tree
def test_the_tree_is_the_documented_one():
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert packages == SUBPACKAGES
    assert modules == TOP_MODULES


def test_no_module_is_named_private_and_there_is_no_utils():
    names = [p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")]
    private = [
        n for n in names if Path(n).name.startswith("_") and not Path(n).name.startswith("__")
    ]
    assert private == []
    assert [n for n in names if Path(n).stem == "utils"] == []


# ---------------------------------------------------------------------------- private names
def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_our_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_name_uses(path: Path) -> list[str]:
    """``"file:line: ..."`` for each private name of another module of ours that ``path``
    imports (``from maxent_arrow.x import _y``) or reaches through a module (``x._y``), and
    each import of a ``_module`` of ours."""
    module = _module_of(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(ROOT).as_posix()
    found: list[str] = []
    module_aliases: set[str] = set()  # local names bound to modules of ours
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, path.name == "__init__.py")
            if target.split(".")[0] != "maxent_arrow":
                continue
            if any(_is_private(part) for part in target.split(".")):
                found.append(f"{where}:{node.lineno}: imports private module {target}")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{where}:{node.lineno}: imports {alias.name} from {target}")
                elif _is_our_module(f"{target}.{alias.name}"):
                    module_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "maxent_arrow":
                    continue
                if any(_is_private(part) for part in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: imports private module {alias.name}")
                module_aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and _is_private(node.attr)
        ):
            found.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return found


def test_the_private_name_check_finds_each_form(tmp_path, monkeypatch):
    # The check itself can fail: a file with every forbidden form, placed inside the package.
    package = tmp_path / "maxent_arrow"
    (package / "compute").mkdir(parents=True)
    for name in ("__init__.py", "compute/__init__.py", "compute/segments.py"):
        (package / name).write_text("")
    (package / "compute" / "bad.py").write_text(
        "from maxent_arrow.compute.segments import _derive, Segments\n"
        "from . import segments as S, _hidden\n"
        "from maxent_arrow.compute._hidden import x\n"
        "import maxent_arrow.compute._hidden\n"
        "S._CACHE\n"
        "S.Segments\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = private_name_uses(package / "compute" / "bad.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports _derive from maxent_arrow.compute.segments",
        "imports _hidden from maxent_arrow.compute",
        "imports private module maxent_arrow.compute._hidden",
        "imports private module maxent_arrow.compute._hidden",
        "uses S._CACHE",
    ]


# types/ is being rewritten; their private imports are listed in the
# xfail reasons so that the rewrite knows what to remove (and strict, so that it removes these
# marks once it has).
_PRIVATE_NAME_DEBT = {}


@pytest.mark.parametrize(
    "part",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=_PRIVATE_NAME_DEBT[name]))
        if name in _PRIVATE_NAME_DEBT
        else name
        for name in [*SUBPACKAGES, "top-level modules"]
    ],
)
def test_no_private_name_crosses_a_module_boundary(part):
    if part == "top-level modules":
        paths = [PACKAGE / "__init__.py", *(PACKAGE / f"{m}.py" for m in TOP_MODULES)]
    else:
        paths = sorted((PACKAGE / part).rglob("*.py"))
    found = [line for path in paths for line in private_name_uses(path)]
    assert found == []


# ---------------------------------------------------------------------------- package contracts
def _stub_exports(package: Path) -> set[str]:
    return {
        alias.name
        for node in ast.parse((package / "__init__.pyi").read_text(encoding="utf-8")).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def imports_around_a_package(path: Path) -> list[str]:
    """``"file:line: ..."`` for each name that ``path`` imports from a module of another of
    our packages although that package exports it (``from maxent_arrow.arrow.lists import
    list_offsets`` instead of ``from maxent_arrow.arrow import list_offsets``)."""
    module = _module_of(path)
    own = module.split(".")[1] if module.count(".") else None
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        parts = _absolute(node, module, path.name == "__init__.py").split(".")
        if parts[0] != "maxent_arrow" or len(parts) < 3 or parts[1] == own:
            continue
        package = ROOT.joinpath(*parts[:2])
        if not (package / "__init__.pyi").is_file():
            continue
        exported = _stub_exports(package)
        for alias in node.names:
            if alias.name in exported:
                where = path.relative_to(ROOT).as_posix()
                found.append(f"{where}:{node.lineno}: {alias.name} from {'.'.join(parts)}")
    return found


def test_the_package_contract_check_finds_an_import_around_a_package(tmp_path, monkeypatch):
    package = tmp_path / "maxent_arrow"
    (package / "arrow").mkdir(parents=True)
    (package / "compute").mkdir()
    (package / "arrow" / "__init__.pyi").write_text("from .lists import first as first\n")
    (package / "compute" / "bad.py").write_text(
        "from maxent_arrow.arrow.lists import first, helper\n"
        "from maxent_arrow.arrow import first\n"
        "from maxent_arrow.compute.own import first\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = imports_around_a_package(package / "compute" / "bad.py")
    assert [line.split(": ", 1)[1] for line in found] == ["first from maxent_arrow.arrow.lists"]


def test_exported_names_are_imported_from_the_package_that_exports_them():
    """A name in another package's exports is imported from that package (lazily, so at no
    cost); only helpers outside its exports come from their defining module."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert [line for path in paths for line in imports_around_a_package(path)] == []


# ---------------------------------------------------------------------------- public names
def test_the_public_surface_is_pinned():
    assert sorted(maxent_arrow.__all__) == PUBLIC_SURFACE


def test_every_public_name_resolves_and_is_listed_by_dir():
    listed = dir(maxent_arrow)
    for name in maxent_arrow.__all__:
        assert name in listed, name
        assert getattr(maxent_arrow, name) is not None, name
    # A re-export is the object of its home package, not a copy.
    assert maxent_arrow.Ragged is importlib.import_module("maxent_arrow.arrow").Ragged
    assert maxent_arrow.recompute is importlib.import_module("maxent_arrow.rollout").recompute


def test_names_are_reachable_from_the_package_that_owns_them():
    from maxent_arrow.compute import evaluate_losses
    from maxent_arrow.ingest import GroupCollator
    from maxent_arrow.rollout import recompute

    assert recompute.__module__ == "maxent_arrow.rollout.recompute"
    assert GroupCollator.__module__ == "maxent_arrow.ingest.collate"
    assert evaluate_losses.__module__ == "maxent_arrow.compute.loss"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_name_a_subpackage_exports_resolves(name):
    package = importlib.import_module(f"maxent_arrow.{name}")
    assert package.__all__, f"maxent_arrow.{name} exports nothing"
    listed = dir(package)
    for export in package.__all__:
        assert export in listed, export
        getattr(package, export)  # imports its module: a name it does not define fails here


def _body(path: Path) -> list[ast.stmt]:
    """The statements of a module, less its docstring."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_a_subpackage_init_only_attaches_its_stub(name):
    # The __init__ imports nothing of ours: lazy_loader reads the exports from __init__.pyi.
    body = _body(PACKAGE / name / "__init__.py")
    assert [ast.unparse(node) for node in body] == [
        "import lazy_loader",
        "__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)",
    ]


@pytest.mark.parametrize("name", ["maxent_arrow", *SUBPACKAGES])
def test_a_package_stub_only_re_exports_names_of_its_own_modules(name):
    """Each ``__init__.pyi`` is the one declaration of its package's exports: ``from .module
    import name as name`` only (the form a type checker treats as a re-export and the only form
    ``attach_stub`` reads), from modules of the package, each name once."""
    package = PACKAGE if name == "maxent_arrow" else PACKAGE / name
    body = _body(package / "__init__.pyi")
    if name == "maxent_arrow":
        assert ast.unparse(body[0]) == "__version__: str"  # set in __init__.py, not lazily
        body = body[1:]
    seen: list[str] = []
    for node in body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        assert node.level == 1 and node.module, ast.unparse(node)
        home = package.joinpath(*node.module.split("."))
        assert home.with_suffix(".py").is_file() or (home / "__init__.py").is_file(), node.module
        for alias in node.names:
            assert alias.asname == alias.name, f"{node.module}: {alias.name} as {alias.asname}"
            seen.append(alias.name)
    assert len(seen) == len(set(seen)), sorted(n for n in seen if seen.count(n) > 1)
    exported = importlib.import_module(f"maxent_arrow.{name}" if name != "maxent_arrow" else name)
    assert sorted(seen) == sorted(n for n in exported.__all__ if n != "__version__")


_REVEALED = re.compile(r'Type of "(?P<expression>.+)" is "(?P<type>.*)"', re.DOTALL)


def test_a_type_checker_sees_the_types_of_public_names():
    """basedpyright, the checker ``make test`` runs, resolves public names of several
    packages through the lazy exports to their real classes and signatures (a package whose
    ``__getattr__`` hides them would give ``Any``): each ``reveal_type`` of
    ``tests/typecheck/public_names.py`` is the type written beside it."""
    checked = ROOT / "tests" / "typecheck" / "public_names.py"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "basedpyright",
            "--outputjson",
            "--pythonpath",
            sys.executable,
            str(checked),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(result.stdout)
    diagnostics = report["generalDiagnostics"]
    assert [d for d in diagnostics if d["severity"] != "information"] == [], result.stdout
    revealed = {}
    for d in diagnostics:
        match = _REVEALED.fullmatch(d["message"])
        assert match, d["message"]
        revealed[d["range"]["start"]["line"] + 1] = match["type"]
    lines = checked.read_text(encoding="utf-8").splitlines()
    expected = {
        n: line.split("  # ", 1)[1]
        for n, line in enumerate(lines, start=1)
        if line.startswith("reveal_type(")
    }
    assert len(expected) >= 10
    assert revealed == expected


def test_the_wheel_ships_the_stubs_and_imports_from_them(tmp_path):
    """A built wheel holds ``py.typed`` and every package's ``__init__.pyi`` (lazy_loader reads
    the stub at import time, so a wheel without one could not even be imported), and imports."""
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "maxent_arrow", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(source),
            "-w",
            str(tmp_path / "dist"),
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if n.endswith((".pyi", "py.typed"))}
        archive.extractall(tmp_path / "site")
    stubs = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("__init__.pyi")}
    assert len(stubs) == len(SUBPACKAGES) + 1
    assert shipped == stubs | {"maxent_arrow/py.typed"}
    code = (
        "import maxent_arrow, maxent_arrow.store\n"
        "print(maxent_arrow.__file__, maxent_arrow.store.RolloutStore.__module__)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    where, module = out.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "site") and module == "maxent_arrow.store.store"


# ---------------------------------------------------------------------------- no torch
def _imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` output (one line per first import)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def _importtime(*args: str, timeout: int = 120) -> tuple[str, set[str]]:
    """Run ``python -X importtime *args`` from the repository; its stdout and the modules it
    imported (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, _imported_modules(result.stderr)


def _torch_modules(names: set[str]) -> list[str]:
    return sorted(n for n in names if n == "torch" or n.startswith("torch."))


def test_importing_the_light_packages_imports_no_torch_and_no_module():
    code = (
        "import maxent_arrow, maxent_arrow.store, maxent_arrow.analytics, maxent_arrow.cli\n"
        "import sys\n"
        "assert 'torch' not in sys.modules\n"
        + "".join(f"import maxent_arrow.{name}\n" for name in SUBPACKAGES)
    )
    _, imported = _importtime("-c", code)
    assert "maxent_arrow.cli" in imported  # the import log is real
    assert _torch_modules(imported) == []
    # Importing a package imports none of its modules (the lazy-export rule): only the
    # packages, the cli and the errors it imports.
    ours = sorted(n for n in imported if n.split(".")[0] == "maxent_arrow")
    expected = ["maxent_arrow", "maxent_arrow.cli", "maxent_arrow.errors"]
    assert ours == sorted(expected + [f"maxent_arrow.{name}" for name in SUBPACKAGES])


def test_maxent_arrow_help_imports_no_torch():
    # The console script's own path: `main()` with the arguments from sys.argv.
    out, imported = _importtime("-m", "maxent_arrow.cli", "--help")
    assert "usage: maxent-arrow" in out
    assert "maxent_arrow.errors" in imported
    assert _torch_modules(imported) == []


def test_subcommand_help_imports_no_torch():
    # Every subcommand but `demo`, whose parser lives with the job (which needs torch).
    commands = ["inspect", "query", "report", "verify", "compact", "export"]
    code = (
        "import sys\n"
        "from maxent_arrow.cli import main\n"
        f"for command in {commands!r}:\n"
        "    assert main([command, '--help']) == 0, command\n"
        "    assert 'torch' not in sys.modules, command\n"
    )
    out, imported = _importtime("-c", code)
    assert out.count("usage: maxent-arrow") == len(commands)
    assert _torch_modules(imported) == []


# ---------------------------------------------------------------------------- import-linter
def _lint_imports(cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "import sys\nfrom importlinter.cli import lint_imports_command\nlint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _contract_results(output: str) -> dict[str, str]:
    """``{contract name: "KEPT" | "BROKEN"}`` from lint-imports' summary lines
    (``<name> KEPT (1 ignored import)``, ``<name> BROKEN``)."""
    results = {}
    for line in output.splitlines():
        for contract in CONFIG["contracts"]:
            name = contract["name"]
            if line.startswith(f"{name} "):
                results[name] = line[len(name) :].split()[0]
    return results


def test_import_contracts_hold():
    result = _lint_imports(ROOT, _env())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    results = _contract_results(result.stdout)
    assert results == {c["name"]: "KEPT" for c in CONFIG["contracts"]}


def test_each_import_contract_catches_its_violation(tmp_path):
    # A copy of the package with one violation per contract: an upward import (arrow ->
    # compute; in the store, storage -> history), a cycle inside compute (segments <-> loss),
    # a private module imported from outside its package (rollout -> compute._hidden;
    # rollout may import compute).
    shutil.copytree(
        PACKAGE, tmp_path / "maxent_arrow", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    copy = tmp_path / "maxent_arrow"
    with open(copy / "arrow" / "lists.py", "a", encoding="utf-8") as f:
        f.write("\nfrom maxent_arrow.compute import kl  # noqa\n")
    # (the store's own layers: a storage primitive that reads the history)
    with open(copy / "store" / "storage" / "names.py", "a", encoding="utf-8") as f:
        f.write("\nimport maxent_arrow.store.history.log  # noqa\n")
    with open(copy / "compute" / "segments.py", "a", encoding="utf-8") as f:
        f.write("\nimport maxent_arrow.compute.loss  # noqa\n")
    (copy / "compute" / "_hidden.py").write_text("")
    with open(copy / "rollout" / "config.py", "a", encoding="utf-8") as f:
        f.write("\nimport maxent_arrow.compute._hidden  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = _lint_imports(tmp_path, env)
    assert result.returncode != 0
    assert _contract_results(result.stdout) == {c["name"]: "BROKEN" for c in CONFIG["contracts"]}, (
        result.stdout[-4000:]
    )


def _exemptions() -> list[tuple[str, str]]:
    entries = {
        tuple(part.strip() for part in entry.split("->"))
        for contract in CONFIG["contracts"]
        for entry in contract.get("ignore_imports", [])
    }
    return sorted(entries)


def test_the_import_contracts_have_no_exemptions():
    """Every import rule holds without exceptions: no ``ignore_imports`` and no package left
    out of a contract (the redesign removed the last ones)."""
    assert _exemptions() == []
    assert [p for c in CONFIG["contracts"] for p in c.get("skip_descendants", [])] == []


# Modules a command may not load: torch (seconds), and for the SQL path pandas (~0.7 s, which
# DuckDB imports when handed a Python object) and pyarrow.dataset (~0.7 s, object stores only).
# The commands that only read load none of the write side either (the store's read side is
# ReadOnlyStore): no writer, commit, compaction, repair, replay or RolloutStore module.
_WRITE_SIDE = tuple(
    f"maxent_arrow.store.{m}"
    for m in (
        "store", "io.writer", "io.commit", "upkeep.compaction", "upkeep.repair", "io.replay"
    )
)
_HEAVY = {
    "inspect": ("torch", "pandas", "pyarrow.dataset", *_WRITE_SIDE),
    "query": ("torch", "pandas", "pyarrow.dataset", *_WRITE_SIDE),
    "verify": ("torch", "pandas", "pyarrow.dataset", *_WRITE_SIDE),
    "compact": ("torch", "pyarrow.dataset"),  # pyarrow imports pandas building arrays
    "export": ("torch", "pyarrow.dataset", *_WRITE_SIDE),
    "report": ("torch", *_WRITE_SIDE),
    # torch only for a run that stored sampler log-probs or kept sets (this one has neither);
    # its group-bys and joins are numpy's (pyarrow's Acero imports pandas)
    "offpolicy": ("torch", "pandas", "pyarrow.dataset", *_WRITE_SIDE),
    "tail": ("torch", "pandas", "pyarrow.dataset", *_WRITE_SIDE),
}


@pytest.mark.parametrize("command", sorted(_HEAVY))
def test_commands_on_a_real_store_import_only_what_they_need(tmp_path, command):
    """Each command run for real, in a new interpreter, on a store with data: the modules it
    imported (``-X importtime``) include none of the heavy ones it does not need."""
    from maxent_arrow import RolloutStore
    from maxent_arrow.testing import make_batch

    store = RolloutStore.create(tmp_path / "store")
    for step in range(3):
        store.append(make_batch(step))
    store.append_records("lifecycle_notes", pa.table({"step": [0], "note": ["x"]}))
    # lifecycle records (the groups view leaves out the dropped) and a resumed attempt (the
    # records' cutoffs): the read side filters them without building arrays from Python values
    store.record_lifecycle(store.read(steps=[0]), step=0, event="dropped", reason="zero_std")
    store = RolloutStore(store.root, attempt="resumed", resume_from=2)
    store.append(make_batch(2))
    store.record_lifecycle(store.read(steps=[1]), step=1, event="trained")
    store.checkpoint()  # opened from a log checkpoint and its record tables, as a long run is
    argv = {
        "inspect": ["inspect", str(store.root)],
        "query": ["query", str(store.root), "SELECT step, avg(total_util) FROM samples GROUP BY 1"],
        "verify": ["verify", str(store.root)],
        "compact": ["compact", str(store.root)],
        "export": ["export", str(store.root), "--to", "ipc", str(tmp_path / "out")],
        "report": ["report", str(store.root), "--out", str(tmp_path / "report")],
        "offpolicy": ["offpolicy", str(store.root)],
        "tail": ["tail", str(store.root), "--since", "0", "--timeout", "0.1"],
    }[command]
    _, imported = _importtime("-m", "maxent_arrow.cli", *argv, timeout=180)
    assert "maxent_arrow.store.history.catalog" in imported  # the log is real
    heavy = sorted(n for n in imported for h in _HEAVY[command] if n == h or n.startswith(h + "."))
    assert heavy == [], (command, heavy)


# ---------------------------------------------------------------------------- the maps
_DOTTED = re.compile(r"(?<![\w./])maxent_arrow(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_PATH = re.compile(r"(?<![\w./])maxent_arrow/[A-Za-z0-9_/]+\.py\b")
_MOD_ROLE = re.compile(r":mod:`~?(\.?[A-Za-z_][A-Za-z0-9_.]*)`")


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the package, or an attribute of one (a class, a
    function, a method)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            return False
        return True
    return False


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _metadata_keys() -> set[str]:
    """Names of the package's file-metadata keys (``b"maxent_arrow.schema_version"``...):
    dotted like a module, but keys, not references."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        found.update(
            re.findall(r'b"(maxent_arrow\.[a-z0-9_.]+)"', path.read_text(encoding="utf-8"))
        )
    return found


def _documents() -> list[tuple[Path, str]]:
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    return [(p, p.read_text(encoding="utf-8")) for p in [*files, ROOT / "README.md"]]


def test_every_reference_to_the_package_in_docs_and_docstrings_resolves():
    """``maxent_arrow.x.y`` names, ``maxent_arrow/x/y.py`` paths and ``:mod:`` roles (also
    relative ones, ``:mod:`.names```) in the docs, the README and the package's own source
    point at modules and names that exist: a map that names a module that is gone misleads."""
    keys = _metadata_keys()
    assert "maxent_arrow.schema_version" in keys  # the key scan is real
    broken = []
    for path, text in _documents():
        where = path.relative_to(ROOT)
        for match in _DOTTED.finditer(text):
            name = match.group(0).rstrip(".")
            placeholder = any(len(part) == 1 for part in name.split(".")[1:])  # maxent_arrow.x
            if name not in keys and not placeholder and not _resolves(name):
                broken.append(f"{where}: {name}")
        for match in _PATH.finditer(text):
            if not (ROOT / match.group(0)).is_file():
                broken.append(f"{where}: {match.group(0)}")
        if path.suffix != ".py":
            continue
        package = _module_name(path)
        if path.name != "__init__.py":
            package = package.rpartition(".")[0]
        for match in _MOD_ROLE.finditer(text):
            ref = match.group(1)
            if ref.startswith("."):
                ref = package + ref
            if not _resolves(ref):
                broken.append(f"{where}: :mod:`{match.group(1)}`")
    assert broken == [], "\n".join(broken)


def test_the_architecture_doc_names_every_module():
    """``docs/architecture.md`` is the map of the tree: every module of every subpackage is
    named there (as ``name`` in its package's paragraph, or by its dotted path)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for package in SUBPACKAGES:
        for module in sorted((PACKAGE / package).rglob("*.py")):
            if module.name == "__init__.py":
                continue
            rel = module.relative_to(PACKAGE).with_suffix("").as_posix()
            if f"`{module.stem}`" not in text and rel not in text:
                missing.append(f"{rel}.py")
    assert missing == [], missing


# ---------------------------------------------------------------------------- the data model
def _column_name_literals() -> list[str]:
    """Literal lists, tuples, sets and dict keys of four or more registered column names in
    the package, outside the registry: a list of columns written out by hand, where the
    registry would give it."""
    from maxent_arrow.arrow import registry as R

    names = set(R.names(R.GROUP)) | set(R.names(R.STEP))
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "registry.py" and path.parent.name == "arrow":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.List | ast.Tuple | ast.Set):
                items = node.elts
            elif isinstance(node, ast.Dict):
                items = [k for k in node.keys if k is not None]
            else:
                continue
            strings = {i.value for i in items if isinstance(i, ast.Constant)}
            hits = sorted(strings & names)
            if len(hits) >= 4:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hits}")
    return found


def test_no_hand_written_list_of_stored_columns_outside_the_registry():
    """Every stored column is declared once (``maxent_arrow/arrow/registry.py``); lists of
    columns are derived from it (by level, family, the seed field they feed, keys)."""
    assert _column_name_literals() == []
