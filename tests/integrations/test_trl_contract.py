"""The declaration of what we rely on in TRL (maxent_arrow.integrations.trl_contract), checked
both ways: against the installed TRL (the methods we override or call have the parameters we
pass, the ``GRPOConfig`` fields and trainer attributes we read exist on a trainer that trained,
the output keys and their order are those ``_generate_and_score_completions`` writes and a real
run returns) and against our own modules (each TRL attribute, config field and method they use
is declared, and nothing declared goes unused). A TRL release that moves any of it fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from maxent_arrow.compute.offpolicy import TRL_IS_MODES  # noqa: E402
from maxent_arrow.errors import SchemaError  # noqa: E402
from maxent_arrow.integrations.trl_contract import (  # noqa: E402
    ALWAYS_OUTPUT_KEYS,
    CALLED_METHODS,
    CONFIG_FIELDS,
    METRIC_COUNTS,
    OPTIONAL_OUTPUT_KEYS,
    OUTPUT_KEYS,
    OVERRIDDEN_METHODS,
    TOKEN_COLUMNS,
    TRAINER_ATTRIBUTES,
    TRL_VERSION,
    TrlOutput,
    concat_outputs,
)

ROOT = Path(__file__).resolve().parents[2]
INTEGRATIONS = ROOT / "maxent_arrow" / "integrations"
# Our modules that touch TRL's trainer: the recorder, its config, tables and contract, and
# the store-fed trainer.
MODULES = sorted(INTEGRATIONS.glob("trl*.py"))
# Our classes over TRL's trainer, and the names their methods call a trainer or its config.
TRAINER_BASES = {"_Trainer", "GRPOTrainer", "RolloutRecorder"}
TRAINER_NAMES = {"self", "trainer"}
CONFIG_NAMES = {"args", "trl_args"}


# ---------------------------------------------------------------------------- against TRL
def test_the_declared_release_is_the_pinned_and_installed_one():
    import trl

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    major, minor = (int(part) for part in TRL_VERSION.split("."))
    assert f"trl>={TRL_VERSION},<{major}.{minor + 1}" in extras["trl"]
    assert trl.__version__.startswith(TRL_VERSION + ".")


@pytest.mark.parametrize("method", [*OVERRIDDEN_METHODS, *CALLED_METHODS], ids=lambda m: m.name)
def test_each_method_we_override_or_call_has_the_parameters_we_rely_on(method):
    have = list(inspect.signature(getattr(GRPOTrainer, method.name)).parameters)
    want = list(method.parameters)
    if method.match == "exact":
        assert have == want
    elif method.match == "prefix":
        assert have[: len(want)] == want
    else:
        assert [n for n in have if n in want] == want


def test_each_config_field_we_read_is_a_grpo_config_field():
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert sorted(CONFIG_FIELDS - fields) == []


def test_the_importance_sampling_modes_are_trls():
    """compute.offpolicy's ``TRL_IS_MODES`` (the values of ``vllm_importance_sampling_mode``
    it reproduces) are those GRPOConfig documents."""
    help_text = GRPOConfig.__dataclass_fields__["vllm_importance_sampling_mode"].metadata["help"]
    listed = re.findall(r"'(\w+_(?:truncate|mask))'", help_text)
    assert listed == list(TRL_IS_MODES)


def test_the_output_keys_are_those_trl_writes_in_its_order():
    """Every key ``_generate_and_score_completions`` puts in its output, in the order it does,
    read from its source: the dict literal, then each ``output["key"] = ...``."""
    tree = ast.parse(
        textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    )
    found: list[tuple[int, int, str]] = []  # (line, position, key)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "output":
            assert isinstance(node.value, ast.Dict)
            literal = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            found += [(node.lineno, i, key) for i, key in enumerate(literal)]
        elif (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and target.value.id == "output"
            and isinstance(target.slice, ast.Constant)
        ):
            found.append((node.lineno, 0, target.slice.value))
    keys = [key for *_, key in sorted(found)]
    assert keys[: len(ALWAYS_OUTPUT_KEYS)] == sorted(ALWAYS_OUTPUT_KEYS, key=OUTPUT_KEYS.index)
    assert keys == list(OUTPUT_KEYS)
    assert set(TOKEN_COLUMNS) <= OPTIONAL_OUTPUT_KEYS


def test_a_real_runs_output_is_read_and_written_back_as_trl_returned_it(plain_run):
    """The keys of each round's output (β > 0, two iterations per round: the old and
    reference log-probs too); the reader keeps each value (no copy) and the writer gives the
    dict back key for key, in TRL's order."""
    _, probe = plain_run
    assert probe.generated
    for _step, _kind, output in probe.generated:
        assert set(output) == ALWAYS_OUTPUT_KEYS | {"old_per_token_logps", "ref_per_token_logps"}
        read = TrlOutput.read(output)
        assert read.unknown == frozenset() and read.rows == output["completion_ids"].shape[0]
        written = read.to_dict()
        assert list(written) == list(output)
        assert all(written[k] is output[k] for k in output)


def test_a_trainer_that_trained_has_every_attribute_we_read(plain_run):
    _, probe = plain_run
    assert [name for name in TRAINER_ATTRIBUTES if not hasattr(probe, name)] == []
    # What the reward functions logged is where the recorder reads it: dicts TRL gathers and
    # clears right after _calculate_rewards; _metrics per mode, cleared by TRL's log.
    assert isinstance(probe._pending_extra_logs, dict) and isinstance(probe._pending_metrics, dict)
    assert set(probe._metrics) == {"train", "eval"}
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert source.index("_calculate_rewards(") < source.index("self._pending_extra_logs.clear()")


def test_the_counted_metrics_are_appended_once_per_loss_batch_and_round(plain_run):
    """``METRIC_COUNTS``: TRL appends one ``entropy`` per loss computation and one ``reward``
    per generation round, so the records count one loss batch per optimizer step and a round at
    the steps that generated one (0 and 2, logged at 1 and 3)."""
    _, probe = plain_run
    records = probe.trainer_metrics().to_pylist()
    assert [r["optimizer_step"] for r in records] == [1, 2, 3]
    assert [r["loss_batches"] for r in records] == [1, 1, 1]
    assert [r["rounds"] for r in records] == [1, 0, 1]
    # TRL logs the mean of an entry it appended to since the last log, and only then.
    logged = [e for e in probe.state.log_history if "loss" in e]
    for record, entry in zip(records, logged, strict=True):
        for count, key in METRIC_COUNTS.items():
            assert (key in entry) == (record[count] > 0), (record["optimizer_step"], key)


# ---------------------------------------------------------------------------- against our code
def _trainer_scopes(tree: ast.Module) -> tuple[list[ast.AST], list[ast.ClassDef]]:
    """Our classes over TRL's trainer, and the module functions that take a ``trainer``."""
    classes = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and {b.id for b in node.bases if isinstance(b, ast.Name)} & TRAINER_BASES
    ]
    functions = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(a.arg == "trainer" for a in node.args.kwonlyargs + node.args.args)
    ]
    return [*classes, *functions], classes


def _defined(classes: list[ast.ClassDef]) -> tuple[set[str], set[str]]:
    """The methods our trainer classes define, and the attributes they assign on ``self``."""
    methods, assigned = set(), set()
    for cls in classes:
        methods |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(cls):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        if t.value.id == "self":
                            assigned.add(t.attr)
    return methods, assigned


def _uses(scopes: list[ast.AST]) -> tuple[set[str], set[str], set[str]]:
    """Attributes read on a trainer, fields read on its config, methods called on super()."""
    attributes, config, supers = set(), set(), set()
    for scope in scopes:
        for node in ast.walk(scope):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in TRAINER_NAMES:
                attributes.add(node.attr)
            if (isinstance(value, ast.Name) and value.id in CONFIG_NAMES) or (
                isinstance(value, ast.Attribute)
                and value.attr == "args"
                and isinstance(value.value, ast.Name)
                and value.value.id in TRAINER_NAMES
            ):
                config.add(node.attr)
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "super"
            ):
                supers.add(node.attr)
    return attributes, config, supers


@pytest.fixture(scope="module")
def our_uses() -> dict[str, set[str]]:
    scopes, classes = [], []
    for path in MODULES:
        found, cls = _trainer_scopes(ast.parse(path.read_text(encoding="utf-8")))
        scopes += found
        classes += cls
    methods, assigned = _defined(classes)
    attributes, config, supers = _uses(scopes)
    assert {"RolloutRecorder", "StoreFedGRPOTrainer"} <= {c.name for c in classes}  # a real scan
    return {
        "methods": methods,
        "ours": methods | assigned,
        "attributes": attributes,
        "config": config,
        "supers": supers,
    }


def test_every_trainer_attribute_our_modules_read_is_declared_and_used(our_uses):
    called = {m.name for m in CALLED_METHODS}
    trls = our_uses["attributes"] - our_uses["ours"]
    assert sorted(trls - set(TRAINER_ATTRIBUTES) - called) == []  # read, not declared
    assert sorted(set(TRAINER_ATTRIBUTES) - trls) == []  # declared, not read
    assert sorted(called - trls) == []
    assert [name for name in TRAINER_ATTRIBUTES if name in our_uses["ours"]] == []


def test_every_config_field_our_modules_read_is_declared_and_used(our_uses):
    assert sorted(our_uses["config"] - CONFIG_FIELDS) == []
    assert sorted(CONFIG_FIELDS - our_uses["config"]) == []


def test_every_trl_method_our_trainers_override_is_declared(our_uses):
    overridden = {m.name for m in OVERRIDDEN_METHODS}
    assert {n for n in our_uses["methods"] if hasattr(GRPOTrainer, n)} == overridden
    assert our_uses["supers"] <= overridden


# ---------------------------------------------------------------------------- reader and writer
def _part(rows: int, prompt: int, completion: int, **optional: torch.Tensor) -> TrlOutput:
    return TrlOutput(
        prompt_ids=torch.full((rows, prompt), 5),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.int64),
        completion_ids=torch.full((rows, completion), 7),
        completion_mask=torch.ones(rows, completion, dtype=torch.int64),
        advantages=torch.zeros(rows),
        num_items_in_batch=torch.tensor(rows * completion),
        **optional,
    )


def test_the_reader_names_the_required_keys_a_dict_lacks_and_keeps_the_rest():
    output = _part(1, 2, 3).to_dict()
    del output["completion_mask"], output["advantages"]
    with pytest.raises(
        SchemaError, match=r"here: missing TRL keys \['advantages', 'completion_mask'\]"
    ):
        TrlOutput.read(output, where="here")
    given = {**_part(1, 2, 3).to_dict(), "pixel_values": torch.ones(1), "new_key": 1}
    read = TrlOutput.read(given)
    assert read.unknown == {"new_key"} and set(read.others) == {"pixel_values", "new_key"}
    assert list(read.to_dict()) == [*list(_part(1, 2, 3).to_dict()), "pixel_values", "new_key"]


def test_two_parts_are_joined_as_trl_pads_them():
    logps = torch.tensor([[-1.0, -2.0]])
    a = _part(1, 2, 2, old_per_token_logps=logps, ref_per_token_logps=logps)
    b = _part(2, 3, 1, old_per_token_logps=torch.tensor([[-3.0], [-4.0]]))
    batch, only = concat_outputs(a, b, pad_token_id=9)
    assert only == ["ref_per_token_logps"]
    assert batch.prompt_ids.tolist() == [[9, 5, 5], [5, 5, 5], [5, 5, 5]]
    assert batch.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert batch.completion_ids.tolist() == [[7, 7], [7, 9], [7, 9]]
    assert batch.completion_mask.tolist() == [[1, 1], [1, 0], [1, 0]]
    assert batch.old_per_token_logps is not None and batch.ref_per_token_logps is None
    assert batch.old_per_token_logps.tolist() == [[-1.0, -2.0], [-3.0, 0.0], [-4.0, 0.0]]
    assert int(batch.num_items_in_batch) == 4 and batch.rows == 3
