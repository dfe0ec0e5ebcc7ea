"""The context a TRL run's rollouts need, on real ``trl.GRPOTrainer`` runs on CPU: the dataset
row of each group (its index, any JSON answer, the columns asked for, with their types), the
reward functions' ``log_extra`` columns and ``log_metric`` values, the policy version, the
trainer's own figures as ``trainer_metrics`` records equal to TRL's ``log_history``, and the
view that joins TRL's log to the store, step for step."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parent))

import trl_runs  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import ByT5Tokenizer  # noqa: E402

from maxent_arrow import RolloutStore, RunAnalytics  # noqa: E402
from maxent_arrow.arrow import registry as R  # noqa: E402
from maxent_arrow.errors import LayoutError, SchemaError  # noqa: E402
from maxent_arrow.integrations import RoundContext, RoundValues, trl_group_table  # noqa: E402
from maxent_arrow.integrations.context import UserColumns  # noqa: E402
from maxent_arrow.integrations.trl import (  # noqa: E402
    logged_kind,
    register_trl_log,
    rollout_step,
    trl_trainer_metrics,
)
from maxent_arrow.rollout import trainer_metrics_table  # noqa: E402

SOURCES = ("gsm8k", "math")


def context_rows(n: int, offset: int = 0) -> list[dict]:
    """Dataset rows with an int answer, an int task id, a source and a column not asked for."""
    rows = []
    for i, (a, b) in enumerate(trl_runs.PAIRS[offset : offset + n]):
        rows.append(
            {
                "prompt": f"{a}+{b}=",
                "answer": a + b,
                "task_id": 1000 + offset + i,
                "source": SOURCES[(offset + i) % 2],
                "difficulty": float(a),
            }
        )
    return rows


def judge(completions, answer, trainer_state, log_extra, log_metric, **_):
    """A judge: its verdict and the length of what it read (None for every third completion)
    as log_extra columns, its number of calls as a log_metric; from step 2 on a late column."""
    verdicts, lengths = [], []
    for i, (c, a) in enumerate(zip(completions, answer)):
        verdicts.append("right" if trl_runs.text(c).strip().startswith(str(a)) else "wrong")
        lengths.append(None if i % 3 == 0 else len(trl_runs.text(c)))
    log_extra("verdict", verdicts)
    log_extra("read", lengths)
    if trainer_state.global_step >= 2:
        log_extra("late", [1] * len(completions))
    log_metric("judge_calls", float(len(completions)))
    return [1.0 if v == "right" else 0.0 for v in verdicts]


def context_trainer(root: Path, **overrides) -> trl_runs.Probe:
    settings = dict(
        max_steps=3,
        per_device_train_batch_size=8,  # two prompts per round
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=4,  # one prompt per evaluation round
    )
    settings.update(overrides)
    return trl_runs.Probe(
        model=str(trl_runs.model_dir(root)),
        reward_funcs=[judge, trl_runs.length],
        args=trl_runs.grpo_config(root / "out", **settings),
        train_dataset=Dataset.from_list(context_rows(8)),
        eval_dataset=Dataset.from_list(context_rows(2, offset=8)),
        processing_class=ByT5Tokenizer(),
        rollout_store=root / "store",
        record_columns=["task_id", "source"],
        background=False,
    )


@pytest.fixture(scope="module")
def context_run(tmp_path_factory: pytest.TempPathFactory):
    """Three optimizer steps (β > 0, two iterations per round: rounds of two prompts at steps 0
    and 2), an evaluation of two prompts at step 3, logging every step."""
    root = tmp_path_factory.mktemp("trl_context")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = context_trainer(root)
        probe.train()
    said = [str(w.message) for w in caught if "RolloutRecorder" in str(w.message)]
    return root, probe, said


def flat(table: pa.Table, name: str) -> list:
    return [x for row in table.column(name).to_pylist() for x in row]


def completions_log(root: Path, logged_step: int) -> pd.DataFrame:
    return pd.read_parquet(root / "out" / "completions" / f"completions_{logged_step:05d}.parquet")


# ---------------------------------------------------------------------------- dataset context
@pytest.mark.slow
def test_each_group_keeps_its_dataset_row_with_the_datasets_types(context_run):
    """``example_id`` is the row's dataset index, the int answer is stored (as its JSON text),
    the columns asked for are typed ``ds_`` columns equal to the dataset's, and the column not
    asked for is said once."""
    root, _, said = context_run
    store = RolloutStore(root / "store")
    schema = store.schema()
    assert schema.field("ds_task_id").type == pa.int64()  # the dataset's features
    assert schema.field("ds_source").type == pa.string()
    assert [m for m in said if "not recorded: ['difficulty']" in m] == [said[0]]
    for kind, dataset in (("train", context_rows(8)), ("eval", context_rows(2, offset=8))):
        table = store.read(kind=kind)
        assert table.num_rows > 0
        for group in table.select(
            ["example_id", "prompt", "answer", "ds_task_id", "ds_source"]
        ).to_pylist():
            row = dataset[int(group["example_id"])]
            assert group["prompt"] == row["prompt"]
            assert group["answer"] == json.dumps(row["answer"]) == str(row["answer"])
            assert (group["ds_task_id"], group["ds_source"]) == (row["task_id"], row["source"])
    config = next(iter(store.replay(steps=[0]))).run_config
    assert config.extra["dataset"] == {
        "example_id": "index",
        "columns": {"task_id": "int64", "source": "string"},
        "answer": "json",
        "not_recorded": ["difficulty"],
    }


@pytest.mark.slow
def test_log_extra_columns_are_typed_and_equal_trls_own_log(context_run):
    """TRL's ``log_extra`` columns, per completion, equal TRL's completions Parquet row for row;
    a column first logged after the first round is left out, said once, so every file of the
    run has one schema."""
    root, _, said = context_run
    store = RolloutStore(root / "store")
    schema = store.schema()
    assert schema.field("extra_verdict").type.value_type == pa.string()
    assert schema.field("extra_read").type.value_type == pa.float64()  # ints too: numbers
    assert "extra_late" not in schema.names
    assert len([m for m in said if "log_extra columns ['late']" in m]) == 1
    # TRL logs a train round of step s at s + 1 and an evaluation at its step; its eval log at
    # step 3 overwrites the train log of step 3 (trl#6613): the round of step 2 has no log.
    for kind, step, logged in (("train", 0, 1), ("eval", 3, 3)):
        table = store.read(kind=kind, steps=[step])
        log = completions_log(root, logged)
        last = -len(log)
        assert len(log) == len(flat(table, "completions")) == 8
        assert flat(table, "completions")[last:] == log["completion"].tolist()
        assert flat(table, "extra_verdict")[last:] == log["verdict"].tolist()
        read = flat(table, "extra_read")[last:]
        assert read[0] is None and None not in read[1:3]
        np.testing.assert_array_equal(
            [math.nan if v is None else v for v in read], log["read"].to_numpy(dtype=float)
        )
        assert ("late" in log.columns) == (step >= 2)
    files = store.committed_files("groups")
    schemas = {pq.read_schema(f).remove_metadata().to_string() for f in files}
    assert len(files) == 3 and len(schemas) == 1  # train 0, train 2, eval 3: one schema


@pytest.mark.slow
def test_log_metric_values_and_policy_versions_are_in_the_step_rows(context_run):
    root, probe, _ = context_run
    steps = RolloutStore(root / "store").read_steps().to_pylist()
    history = probe.state.log_history
    logged = {(e["step"], logged_kind(e)): e for e in history if logged_kind(e)}
    assert [(r["step"], r["kind"]) for r in steps] == [(0, "train"), (2, "train"), (3, "eval")]
    for r in steps:
        assert r["policy_version"] == r["step"]  # the updates the generating policy had
        assert r["metric_names"] == ["judge_calls"]
        # One call per round: the evaluation ran two rounds (two prompts, batches of 4).
        assert r["metric_counts"] == [1 if r["kind"] == "train" else 2]
        if r["kind"] == "train":  # TRL logs the round of step s at s + 1
            want = logged[(r["step"] + 1, "train")]["judge_calls"]
        else:
            want = logged[(r["step"], "eval")]["eval_judge_calls"]
        assert r["metric_values"] == [want] == [8.0 if r["kind"] == "train" else 4.0]


@pytest.mark.slow
def test_one_query_slices_the_reward_curve_by_source(context_run):
    """The reward curve by dataset source, in one query over the ``samples`` view, equals what
    the stored raw rewards and the dataset's own ``source`` give."""
    root, _, _ = context_run
    got = RolloutStore(root / "store").sql(
        "SELECT step, ds_source AS source, avg(total_util) AS reward, count(*) AS n "
        "FROM samples WHERE kind = 'train' GROUP BY ALL ORDER BY ALL"
    )
    # The same figures from the stored raw rewards and the dataset's source of each prompt.
    source_of = {r["prompt"]: r["source"] for r in context_rows(8)}
    stored = RolloutStore(root / "store").read(kind="train").to_pylist()
    frame = pd.DataFrame(
        [
            (g["step"], source_of[g["prompt"]], sum(values))
            for g in stored
            for values in g["reward_values"]
        ],
        columns=["step", "source", "total"],
    )
    want = [
        (step, source, part["total"].mean(), len(part))
        for (step, source), part in frame.groupby(["step", "source"])
    ]
    rows = got.to_pylist()
    assert [(r["step"], r["source"], r["n"]) for r in rows] == [(s, c, n) for s, c, _, n in want]
    np.testing.assert_allclose([r["reward"] for r in rows], [w[2] for w in want], atol=1e-6)
    assert {r["source"] for r in rows} == set(SOURCES)


# ---------------------------------------------------------------------------- trainer figures
@pytest.mark.slow
def test_trainer_figures_equal_trls_log_history_per_step(context_run):
    """With ``logging_steps=1`` each training record is one optimizer step: its loss, KL,
    entropy, clip ratios, grad norm and learning rate are TRL's ``log_history`` values; it is
    joined to the rollout step that generated its data (steps 1 and 2 train on the round of
    step 0, step 3 on the round of step 2) and states what it averages."""
    root, probe, _ = context_run
    records = probe.trainer_metrics().to_pylist()
    history = [e for e in probe.state.log_history if "loss" in e or "eval_loss" in e]
    assert [(r["optimizer_step"], r["kind"]) for r in records] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (3, "eval"),
    ]
    figures = {c.name: c.logged_as for c in R.columns(R.TRAINER_METRICS) if c.logged_as}
    for record, entry in zip(records, history):
        prefix = "eval_" if record["kind"] == "eval" else ""
        for column, key in figures.items():
            value = entry.get(prefix + key, entry.get(key) if key == "epoch" else None)
            assert record[column] == value, (record["optimizer_step"], column)
        extra = dict(zip(record["metric_names"], record["metric_values"]))
        for key, value in entry.items():
            name = key.removeprefix(prefix)
            if name in extra:
                assert extra[name] == value or (value is None and math.isnan(extra[name]))
    train = records[:3]
    assert [r["step"] for r in train] == [0, 0, 2] and [r["first_step"] for r in train] == [0, 0, 2]
    assert [r["averaged_steps"] for r in train] == [1, 1, 1]
    assert [r["rounds"] for r in train] == [1, 0, 1]  # a round serves two iterations
    assert [r["loss_batches"] for r in train] == [1, 1, 1]
    assert all(r["kl"] > 0 and r["learning_rate"] > 0 and r["grad_norm"] > 0 for r in train)
    evaluation = records[3]
    assert (evaluation["step"], evaluation["averaged_steps"]) == (3, 0)
    assert evaluation["loss"] == probe.state.log_history[-2]["eval_loss"]
    # Rebuilt afterwards from the log alone (a trainer_state.json), the records are the same
    # but for the counts only the recorder sees.
    store = RolloutStore(root / "store")
    again = trl_trainer_metrics(probe.state.log_history, train_steps=store.steps(kind="train"))
    skip = {"created_at", "loss_batches", "rounds"}
    keep = [n for n in again.column_names if n not in skip]
    assert again.select(keep).to_pylist() == probe.trainer_metrics().select(keep).to_pylist()


@pytest.mark.slow
def test_the_trl_log_view_joins_every_logged_step_to_the_store(context_run):
    """``register_trl_log`` puts TRL's log beside the store: every logged training step and
    evaluation joins a stored step, and where a round was logged, TRL's reward is the stored
    step's reward mean."""
    root, probe, _ = context_run
    with RunAnalytics(RolloutStore(root / "store")) as run:
        registered = register_trl_log(run, probe.state.log_history)
        joined = run.sql(
            "SELECT l.optimizer_step AS trl_step, kind, step, l.rounds, s.reward_mean, "
            "l.metric_values[list_position(l.metric_names, 'reward')] AS trl_reward "
            "FROM trl_log l JOIN steps s USING (step, kind) ORDER BY kind DESC, trl_step"
        ).to_pylist()
    logged = [(e["step"], logged_kind(e)) for e in probe.state.log_history if logged_kind(e)]
    assert sorted((r["trl_step"], r["kind"]) for r in joined) == sorted(logged)
    assert registered.num_rows == len(joined) == 4
    assert [r["step"] for r in joined] == [0, 0, 2, 3]
    for r in joined:
        if r["kind"] == "eval" or r["trl_step"] != 2:  # step 2 generated nothing: no reward
            assert r["trl_reward"] == pytest.approx(r["reward_mean"], abs=1e-6)


@pytest.mark.slow
def test_a_resumed_recorder_keeps_the_runs_user_columns(context_run):
    """A recorder opened on the run's store (a resumed run) declares the user columns its files
    have, with their types, and the log_extra columns are fixed already."""
    root, probe, _ = context_run
    with pytest.warns(UserWarning, match="not recorded"):
        resumed = context_trainer(root)
    assert resumed.rollout_columns.types == probe.rollout_columns.types
    assert list(resumed.rollout_columns.types) == [
        "ds_task_id",
        "ds_source",
        "extra_read",
        "extra_verdict",
    ]
    assert resumed.rollout_state.extras == ["read", "verdict"]


@pytest.mark.slow
def test_a_record_of_several_logged_steps_says_what_it_averages(tmp_path):
    """``logging_steps=2``: one record for steps 1-2, averaging two optimizer steps (each a
    round of its own: two loss batches, two rounds), joined to the round of its last step
    (``step``) and of its first (``first_step``)."""
    with pytest.warns(UserWarning, match=r"dataset columns not recorded: \['difficulty'\]"):
        probe = context_trainer(
            tmp_path, logging_steps=2, max_steps=2, num_iterations=1, beta=0.0, eval_strategy="no"
        )
    probe.train()
    ((record,),) = [probe.trainer_metrics().to_pylist()]
    entry = next(e for e in probe.state.log_history if "loss" in e)
    assert (record["optimizer_step"], record["averaged_steps"]) == (2, 2)
    assert (record["step"], record["first_step"]) == (1, 0)
    assert (record["loss_batches"], record["rounds"]) == (2, 2)
    assert record["loss"] == entry["loss"] and record["kl"] is None  # β = 0: TRL logs no KL


# ---------------------------------------------------------------------------- refusals
def test_the_step_rule_joins_a_logged_step_to_the_round_it_trained_on():
    assert [rollout_step(t, "train", [0, 2]) for t in (1, 2, 3, 4)] == [0, 0, 2, 2]
    assert rollout_step(3, "eval", [0, 2]) == 3 and rollout_step(1, "train", []) is None


def test_a_user_column_value_of_another_type_is_refused_naming_column_and_position():
    columns = UserColumns()
    assert columns.dataset_column("task_id", [1, 2], where="w").type == pa.int64()
    with pytest.raises(
        SchemaError, match=r"dataset column 'task_id' at position 1: expected int64"
    ):
        columns.dataset_column("task_id", [3, "x"], where="w")
    columns.extra_values("score", [0.5, None, 1], where="w")
    with pytest.raises(
        SchemaError, match=r"log_extra column 'score' at position 0: expected double"
    ):
        columns.extra_values("score", ["high"], where="w")
    with pytest.raises(SchemaError, match="declared int64 in this run, got string"):
        columns.declare("ds_task_id", pa.string())
    with pytest.raises(SchemaError, match="starts with one of"):
        columns.declare("task_id", pa.int64())
    # Every append carries every declared column, in declaration order, after its own.
    table = columns.complete(pa.table({"step": [0], "extra_score": pa.array([[1.0]])}))
    assert table.column_names == ["step", "ds_task_id", "extra_score"]
    assert table.column("ds_task_id").null_count == 1


def test_a_log_extra_column_of_the_wrong_length_or_a_non_json_answer_is_refused():
    b = 2
    outputs = {
        "prompt_ids": torch.tensor([[5, 6]] * b),
        "prompt_mask": torch.ones(b, 2, dtype=torch.int64),
        "completion_ids": torch.tensor([[7, 1]] * b),
        "completion_mask": torch.ones(b, 2, dtype=torch.int64),
        "advantages": torch.zeros(b),
        "num_items_in_batch": 4,
    }
    context = RoundContext(
        step=0, rank=0, kind="train", group_size=2, reward_names=["r"], reward_weights=[1.0]
    )

    def table_of(**values: Any) -> pa.Table:
        return trl_group_table(
            outputs,
            context,
            RoundValues(prompts=["p", "p"], completions=["a", "b"], **values),
            first_index=0,
            rewards=torch.zeros(b, 1),
        )

    table = table_of(extras={"verdict": ["x", None]}, answers=[[1], [1]])
    assert table.column("extra_verdict").to_pylist() == [["x", None]]
    assert table.column("answer").to_pylist() == ["[1]"]
    with pytest.raises(LayoutError, match="log_extra column 'verdict': expected 2 values"):
        table_of(extras={"verdict": ["x"]})
    with pytest.raises(SchemaError, match="answer of row 0: expected JSON-able"):
        table_of(answers=[object(), object()])


def test_a_trainer_metrics_record_is_checked_before_anything_is_written():
    ok = trainer_metrics_table([{"optimizer_step": 1, "kind": "train", "metrics": {"r": None}}])
    assert ok.column("metric_names").to_pylist() == [["r"]]
    assert math.isnan(ok.column("metric_values")[0][0].as_py())  # None: NaN
    with pytest.raises(SchemaError, match="row 0: unknown columns \\['los'\\]"):
        trainer_metrics_table([{"optimizer_step": 1, "kind": "train", "los": 1.0}])
    with pytest.raises(SchemaError, match="row 1: missing 'kind'"):
        trainer_metrics_table([{"optimizer_step": 1, "kind": "train"}, {"optimizer_step": 2}])
    with pytest.raises(SchemaError, match="metric 'x': expected a number, got str"):
        trainer_metrics_table([{"optimizer_step": 1, "kind": "train", "metrics": {"x": "high"}}])


@pytest.mark.slow
def test_record_columns_the_dataset_lacks_are_refused_when_the_recorder_starts(tmp_path):
    with pytest.raises(SchemaError, match=r"the dataset has no column \['topic'\]"):
        trl_runs.Probe(
            model=str(trl_runs.model_dir(tmp_path)),
            reward_funcs=[trl_runs.length],
            args=trl_runs.grpo_config(tmp_path / "out"),
            train_dataset=Dataset.from_list(context_rows(4)),
            processing_class=ByT5Tokenizer(),
            rollout_store=tmp_path / "store",
            record_columns=["source", "topic"],
        )
    assert not (tmp_path / "store").exists()  # nothing written
