"""The TRL recorder (maxent_arrow.integrations.trl) on real ``trl.GRPOTrainer`` runs on CPU:
every generated completion stored once with the tokens TRL trained on, rewards and advantages
equal to TRL's own ``completions_*.parquet``, chat prompts as typed messages, eval rounds,
two processes writing their own ranks with groups split between them, and TRL's advantages
recomputed under each ``scale_rewards`` (TRL's private surface: test_trl_contract.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parent))

import trl_runs  # noqa: E402

from maxent_arrow import RolloutStore, RunAnalytics, RunConfig, build_report  # noqa: E402
from maxent_arrow.arrow import registry as R  # noqa: E402
from maxent_arrow.errors import LayoutError  # noqa: E402
from maxent_arrow.integrations import (  # noqa: E402
    RoundContext,
    RoundValues,
    trl_group_table,
)
from maxent_arrow.integrations.steps import step_row  # noqa: E402
from maxent_arrow.integrations.trl_contract import ALWAYS_OUTPUT_KEYS  # noqa: E402
from maxent_arrow.rollout import RolloutBatch, reassemble, recompute, recompute_kl  # noqa: E402

WORKER = Path(__file__).parent / "trl_worker.py"


# ---------------------------------------------------------------------------- helpers
def samples(table: pa.Table) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt tokens, completion tokens) of every stored completion."""
    out = []
    for prompt, completions in zip(
        table.column("prompt_ids").to_pylist(), table.column("completion_ids").to_pylist()
    ):
        out.extend((tuple(prompt), tuple(c)) for c in completions)
    return out


def generated(output: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The same pairs from TRL's own output dict (un-padded with its masks)."""
    out = []
    for p, pm, c, cm in zip(
        output["prompt_ids"],
        output["prompt_mask"],
        output["completion_ids"],
        output["completion_mask"],
    ):
        out.append((tuple(p[pm.bool()].tolist()), tuple(c[cm.bool()].tolist())))
    return out


def flat(table: pa.Table, name: str) -> list:
    """A per-completion column flattened in stored order."""
    return [x for row in table.column(name).to_pylist() for x in row]


def trl_parquet(out: Path, logged_step: int) -> pd.DataFrame:
    return pd.read_parquet(out / "completions" / f"completions_{logged_step:05d}.parquet")


def assert_matches_trl_log(step_rows: pa.Table, log: pd.DataFrame, names: list[str]) -> None:
    """Rewards, advantages, prompts and completions of a (reassembled) step equal TRL's
    completions parquet, row for row (TRL logs the gathered batch in global order)."""
    assert len(log) == sum(step_rows.column("num_completions").to_pylist())
    values = np.array(flat(step_rows, "reward_values"))
    for j, name in enumerate(names):
        np.testing.assert_array_equal(values[:, j], log[name].to_numpy())
    np.testing.assert_array_equal(flat(step_rows, "advantages"), log["advantage"].to_numpy())
    assert flat(step_rows, "completions") == [trl_runs.text(c) for c in log["completion"]]


# ---------------------------------------------------------------------------- end to end
# `plain_run` (tests/integrations/conftest.py): the run test_trl_contract.py checks TRL's
# surface on; TRL's surface itself is tested there.


def test_every_generated_completion_is_stored_once_with_the_tokens_trl_trained_on(plain_run):
    root, probe = plain_run
    store = RolloutStore(root / "store")
    assert [(u.step, u.rank, u.kind) for u in store.units()] == [(0, 0, "train"), (2, 0, "train")]
    assert store.verify().problems == []
    for step, _kind, output in probe.generated:
        table = store.read(steps=[step])
        stored = samples(table)
        # Every completion TRL generated is stored, once.
        assert Counter(stored) == Counter(generated(output))
        # And it is what TRL trained on (each round serves num_iterations steps).
        trained = {(p, c) for s, p, c in probe.trained if s == step}
        assert trained == set(stored)
        assert table.column("group_size").to_pylist() == [4] * table.num_rows
        assert flat(table, "completion_index") == [0, 1, 2, 3] * table.num_rows


def test_rewards_and_advantages_equal_trls_completion_log(plain_run):
    root, _ = plain_run
    store = RolloutStore(root / "store")
    # TRL writes a round's rows in the log of the next optimizer step.
    for step in (0, 2):
        table = reassemble(store.read(steps=[step]))
        assert_matches_trl_log(table, trl_parquet(root / "out", step + 1), ["correct", "length"])
        assert table.column("reward_names").to_pylist()[0] == ["correct", "length"]


def test_stored_log_probs_are_trls_and_recompute_reproduces_its_advantages(plain_run):
    root, probe = plain_run
    store = RolloutStore(root / "store")
    batch = next(iter(store.replay(steps=[0])))
    output = next(o for s, k, o in probe.generated if s == 0 and k == "train")
    mask = output["completion_mask"].bool()
    ref = batch.ragged("ref_token_logp")
    old = batch.ragged("behavior_token_logp")
    torch.testing.assert_close(ref.values, output["ref_per_token_logps"][mask], rtol=0, atol=0)
    torch.testing.assert_close(old.values, output["old_per_token_logps"][mask], rtol=0, atol=0)
    # The k3 KL of the stored log-probs is TRL's per-token KL at the round's first pass.
    delta = (output["ref_per_token_logps"] - output["old_per_token_logps"]).double()
    want = (torch.exp(delta) - delta - 1)[mask]
    torch.testing.assert_close(recompute_kl(batch).values, want, rtol=1e-9, atol=1e-9)
    got = recompute(batch)["advantages"].values
    torch.testing.assert_close(got, batch.ragged("advantages").values, rtol=0, atol=1e-6)


def test_a_trl_run_has_the_trl_layout_and_no_maxent_column(plain_run):
    """A TRL run's files (read by DuckDB itself, outside this library) and its views carry
    the core and TRL columns only: no MaxEnt column is written, not even as null padding."""
    root, _ = plain_run
    store = RolloutStore(root / "store")
    maxent_only = {
        c.name for t in (R.GROUP, R.STEP) for c in R.columns(t) if c.families == (R.MAXENT,)
    }
    assert {"q", "weights", "total_loss", "seed_semantic_entropy"} <= maxent_only
    assert store.schemas.families() == ("core", "trl")
    for table in ("groups", "steps"):
        files = [str(p) for p in store.committed_files(table)]
        physical = {
            r[0] for r in duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet({files})").fetchall()
        }
        assert not physical & maxent_only, (table, physical & maxent_only)
        assert "reward_values" in physical or table == "steps"
    for view in ("groups", "samples", "steps"):
        described = {r["column_name"] for r in store.sql(f"DESCRIBE {view}").to_pylist()}
        assert not described & maxent_only, (view, described & maxent_only)
    described = {r["column_name"] for r in store.sql("DESCRIBE samples").to_pylist()}
    assert {"completion", "advantage", "reward_correct", "reward_length"} <= described


def test_step_row_carries_trls_settings_as_the_replay_contract(plain_run):
    root, probe = plain_run
    batch = next(iter(RolloutStore(root / "store").replay(steps=[2])))
    cfg = batch.run_config
    assert isinstance(cfg, RunConfig)
    assert (cfg.beta, cfg.clip_eps_low, cfg.clip_eps_high) == (0.04, 0.2, 0.2)
    assert (cfg.loss_type, cfg.scale_rewards, cfg.unscorable) == ("dapo", "group", "exclude")
    assert (cfg.num_generations, cfg.max_completion_len, cfg.gen_temperature) == (4, 8, 1.0)
    assert cfg.reward_names == ("correct", "length") and cfg.reward_weights == (1.0, 1.0)
    assert cfg.tokenizer["class"] == "ByT5Tokenizer" and cfg.tokenizer["len"] == 384
    assert cfg.extra["trl"]["num_iterations"] == 2
    assert cfg.trainer.startswith("trl.GRPOTrainer")
    info = flat(batch.to_arrow(), "completion_info")
    assert [i["token_count"] for i in info] == [
        len(c) for c in flat(batch.groups, "completion_ids")
    ]
    assert batch.step_row.column("kl_value")[0].as_py() > 0.0


def test_the_off_policy_contract_holds_what_trl_shows(plain_run):
    """Per completion: the policy version TRL generated with (``global_step`` of the round),
    GRPOConfig's sampling parameters and, with no top-p/top-k/min-p cut, ``processed``
    log-prob semantics; DuckDB reads them from the files."""
    root, probe = plain_run
    files = [str(p) for p in RolloutStore(root / "store").committed_files("groups")]
    relation = duckdb.sql(
        "SELECT step, unnest(completion_policy_version) v, unnest(sampling_temperature) t, "
        "unnest(sampling_top_p) p, unnest(sampling_top_k) k, unnest(sampling_min_p) m, "
        f"unnest(behavior_logp_semantics) s FROM read_parquet({files})"
    )
    assert relation is not None
    rows = relation.fetchall()
    args = probe.args
    assert (args.top_p, args.top_k or 0, args.min_p or 0.0) == (1.0, 0, 0.0)
    generated = sum(o["completion_ids"].shape[0] for _, k, o in probe.generated if k == "train")
    assert sorted({r[0] for r in rows}) == [0, 2] and len(rows) == generated == 8
    assert {r[1:] for r in rows if r[0] == 0} == {(0, probe.temperature, 1.0, 0, 0.0, "processed")}
    assert {r[1] for r in rows if r[0] == 2} == {2}
    cfg = next(iter(RolloutStore(root / "store").replay(steps=[0]))).run_config
    assert cfg.extra["trl"]["vllm_importance_sampling_clip_max"] == 3.0


@pytest.mark.slow
def test_chat_prompts_are_typed_messages_and_eval_rounds_are_stored(tmp_path):
    probe = trl_runs.trainer(
        tmp_path,
        background=False,  # the synchronous path: each round durable before the next
        chat=True,
        eval_rows=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        max_steps=2,
        num_iterations=1,
    )
    probe.train()
    store = RolloutStore(tmp_path / "store")
    assert store.verify().problems == []
    assert sorted({(u.step, u.kind) for u in store.units()}) == [
        (0, "train"),
        (1, "train"),
        (2, "eval"),
    ]
    train = store.read(kind="train", steps=[0])
    messages = train.column("prompt_messages").to_pylist()
    assert all(m[0]["role"] == "user" and m[0]["content"].endswith("=") for m in messages)
    # A chat prompt is not also stored as text (the column is the run-wide layout's padding).
    assert train.column("prompt").null_count == train.num_rows
    completion_messages = flat(train, "completion_messages")
    assert {m[0]["role"] for m in completion_messages} == {"assistant"}
    assert [m[0]["content"] for m in completion_messages] == flat(train, "completions")
    rounds: dict[tuple[int, str], Counter] = {}
    for step, kind, output in probe.generated:  # an evaluation runs several rounds
        rounds.setdefault((step, kind), Counter()).update(generated(output))
    assert sorted(rounds) == [(0, "train"), (1, "train"), (2, "eval")]
    for (step, kind), want in rounds.items():
        assert Counter(samples(store.read(kind=kind, steps=[step]))) == want
    # One eval append for the evaluation: both eval prompts, each with its 4 completions.
    evals = store.read(kind="eval")
    assert evals.num_rows == 2 and sum(evals.column("num_completions").to_pylist()) == 8
    assert len(set(evals.column("group_id").to_pylist())) == 2
    # A second evaluation at step 2, by this trainer or by one that continues the run there,
    # is not stored again (the store keeps one eval step per step and rank); the warning says
    # so.
    with pytest.warns(UserWarning, match="eval round at step 2 of rank 0 is already stored"):
        probe.evaluate()
    resumed = trl_runs.trainer(
        tmp_path, chat=True, eval_rows=2, per_device_eval_batch_size=4, if_exists="resume"
    )
    resumed.state.global_step = 2
    with pytest.warns(UserWarning, match="already stored"):
        resumed.evaluate()
    assert RolloutStore(tmp_path / "store").read(kind="eval").num_rows == 2


@pytest.mark.slow
def test_rounds_that_share_an_optimizer_step_are_stored_as_one_step(tmp_path):
    """Two gradient-accumulation micro-steps, a generation each (``steps_per_generation=1``):
    two rounds per optimizer step, stored as one append of that step."""
    probe = trl_runs.trainer(
        tmp_path,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        max_steps=2,
    )
    probe.train()
    store = RolloutStore(tmp_path / "store")
    assert [(u.step, u.kind) for u in store.units()] == [(0, "train"), (1, "train")]
    for step in (0, 1):
        table = store.read(steps=[step])
        assert table.column("group_id").to_pylist() == [f"{step}.0.0", f"{step}.1.0"]
        assert table.column("group_index").to_pylist() == [0, 1]
        want = Counter()
        for s, _kind, output in probe.generated:
            if s == step:
                want.update(generated(output))
        assert Counter(samples(table)) == want and sum(want.values()) == 8


# ---------------------------------------------------------------------------- recompute
@pytest.mark.slow
@pytest.mark.parametrize(
    ("scale_rewards", "aggregation"),
    [
        ("group", "sum_then_normalize"),
        ("batch", "sum_then_normalize"),
        ("none", "sum_then_normalize"),
        ("group", "normalize_then_sum"),
    ],
)
def test_recompute_reproduces_trls_advantages(tmp_path, scale_rewards, aggregation):
    """Two groups per round, reward functions that return None (NaN, and some completions no
    function scores), weighted: the recomputed advantages equal TRL's to 1e-6."""
    probe = trl_runs.trainer(
        tmp_path,
        reward_funcs=[trl_runs.length_or_none, trl_runs.sometimes_none, trl_runs.mostly_none],
        reward_weights=[1.0, 0.5, 2.0],
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
        per_device_train_batch_size=12,
        beta=0.0,
        num_iterations=1,
        max_steps=1,
    )
    probe.train()
    ((_, _, output),) = probe.generated
    assert set(output) == ALWAYS_OUTPUT_KEYS  # β = 0, one iteration: nothing optional
    store = RolloutStore(tmp_path / "store")
    table = reassemble(store.read(steps=[0]))
    names = ["length_or_none", "sometimes_none", "mostly_none"]
    assert_matches_trl_log(table, trl_parquet(tmp_path / "out", 1), names)
    values = np.array(flat(table, "reward_values"))
    assert np.isnan(values).all(axis=1).any()  # some completions are unscorable
    batch = next(iter(store.replay(steps=[0])))
    cfg = batch.run_config
    assert (cfg.scale_rewards, cfg.multi_objective_aggregation) == (scale_rewards, aggregation)
    got = recompute(batch)
    want = output["advantages"].double()
    torch.testing.assert_close(got["advantages"].values, want, rtol=0, atol=1e-6)
    # A what-if: other weights rebuild the utilities from the raw rewards.
    other = recompute(batch, reward_weights=(1.0, 0.0, 0.0))["advantages"].values
    assert not torch.allclose(other, want, atol=1e-3)
    if aggregation == "sum_then_normalize":
        assert "q" not in got  # q is undefined for a group with an unscorable completion


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scale_rewards", "aggregation"),
    [("batch", "sum_then_normalize"), ("group", "normalize_then_sum")],
)
def test_recompute_is_per_generation_round(tmp_path, scale_rewards, aggregation):
    """A step of two generation rounds (two micro-steps, a generation each): TRL normalises
    each round's batch on its own, and so does ``recompute`` (the round is a stored column,
    and part of the group id), to 1e-6."""
    probe = trl_runs.trainer(
        tmp_path,
        reward_funcs=[trl_runs.length_or_none, trl_runs.sometimes_none],
        reward_weights=[1.0, 0.5],
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        max_steps=1,
    )
    probe.train()
    rounds = [o for s, k, o in probe.generated if s == 0 and k == "train"]
    assert len(rounds) == 2
    store = RolloutStore(tmp_path / "store")
    (batch,) = store.replay(steps=[0])
    assert batch.column("round").to_pylist() == [0, 0, 1, 1]
    assert [g.split(".")[1] for g in batch.column("group_id").to_pylist()] == ["0", "0", "1", "1"]
    want = torch.cat([o["advantages"].double() for o in rounds])
    got = recompute(batch)["advantages"].values
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # Pooling the two rounds (what recompute did before) is not what TRL computed.
    pooled = recompute(RolloutBatch(batch.groups.drop_columns(["round"]), batch.step_row))
    assert not torch.allclose(pooled["advantages"].values, want, atol=1e-3)


@pytest.mark.slow
def test_two_reward_functions_of_one_name_stay_two(tmp_path):
    """Two lambdas are both ``<lambda>`` to TRL: the run config keeps the names as given in
    ``reward_functions`` and stores unique ones (``<lambda>``, ``<lambda>_1``), so the views
    have both columns and ``recompute`` weighs each with its own weight, as TRL did."""
    first = lambda completions, **_: [float(len(trl_runs.text(c)) % 3) for c in completions]  # noqa: E731
    second = lambda completions, **_: [-0.1 * len(trl_runs.text(c)) for c in completions]  # noqa: E731
    probe = trl_runs.trainer(
        tmp_path,
        reward_funcs=[first, second],
        reward_weights=[1.0, 3.0],
        beta=0.0,
        num_iterations=1,
        max_steps=1,
    )
    probe.train()
    store = RolloutStore(tmp_path / "store")
    (batch,) = store.replay(steps=[0])
    cfg = batch.run_config
    assert cfg.reward_functions == ("<lambda>", "<lambda>")
    assert cfg.reward_names == ("<lambda>", "<lambda>_1")
    assert batch.column("reward_names").to_pylist()[0] == ["<lambda>", "<lambda>_1"]
    columns = {r["column_name"] for r in store.sql("DESCRIBE samples").to_pylist()}
    assert {"reward_<lambda>", "reward_<lambda>_1"} <= columns
    ((_, _, output),) = [g for g in probe.generated if g[1] == "train"]
    got = recompute(batch)["advantages"].values
    torch.testing.assert_close(got, output["advantages"].double(), rtol=0, atol=1e-6)
    # TRL's own completions log keys its columns by name: the second lambda overwrote the
    # first there; the store keeps both.
    values = np.array(flat(store.read(), "reward_values"))
    log = trl_parquet(tmp_path / "out", 1)
    np.testing.assert_array_equal(values[:, 1], log["<lambda>"].to_numpy())
    assert not np.array_equal(values[:, 0], values[:, 1])


# ---------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_each_write_their_rank_and_groups_reassemble(tmp_path):
    """``accelerate launch`` with two CPU processes (gloo; ``--cpu`` would start only one):
    6 rows per process, groups of 4, so one group is split between the ranks."""
    trl_runs.model_dir(tmp_path)  # once, before the processes race to build it
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),  # no user accelerate config
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path.cwd()), str(WORKER.parent), os.environ.get("PYTHONPATH")])
        ),
    }
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        str(WORKER), str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in reports] == [2, 2]
    store = RolloutStore(tmp_path / "store")
    assert store.verify().problems == []
    units = sorted((u.step, u.rank) for u in store.units())
    assert units == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for step in (0, 1):
        parts = store.read(steps=[step])
        assert sorted(set(parts.column("rank").to_pylist())) == [0, 1]
        assert parts.num_rows == 4  # rank 0: group 0 and half of 1; rank 1: the rest
        table = reassemble(parts)
        assert table.num_rows == 3
        assert table.column("num_completions").to_pylist() == [4, 4, 4]
        assert flat(table, "completion_index") == [0, 1, 2, 3] * 3
        # Nothing lost or doubled: the stored samples are both ranks' generated ones.
        want = Counter(tuple(map(tuple, s)) for r in reports for s in r["generated"][str(step)])
        assert Counter(samples(table)) == want
        assert_matches_trl_log(
            table, trl_parquet(tmp_path / "out", step + 1), ["correct", "length"]
        )
        cfg = next(iter(store.replay(steps=[step]))).run_config
        assert cfg.scale_rewards == "batch" and cfg.extra["trl"]["world_size"] == 2
        got = recompute(table, cfg)["advantages"].values
        want = torch.tensor(flat(table, "advantages"), dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------- the builder
def _outputs(b: int, width: int, lengths: list[int], **extra: torch.Tensor) -> dict:
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(10, 10 + n)
        ids[i, n - 1] = 1 if i % 2 == 0 else ids[i, n - 1]  # even rows end in EOS
        mask[i, :n] = 1
    prompt = torch.tensor([[0, 5, 6]] * b)
    return {
        "prompt_ids": prompt,
        "prompt_mask": (prompt != 0).long(),
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": torch.linspace(-1, 1, b),
        "num_items_in_batch": mask.sum(),
        **extra,
    }


def test_group_table_keeps_the_optional_tensors_trl_gives_with_vllm_and_tools():
    b, width, lengths = 4, 5, [5, 2, 3, 1]
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    sampling = torch.randn(b, width)
    outputs = _outputs(
        b,
        width,
        lengths,
        sampling_per_token_logps=sampling,
        importance_sampling_ratio=torch.rand(b, 1),
        tool_mask=torch.ones(b, width, dtype=torch.int64),
    )
    chat = [[{"role": "user", "content": [{"type": "image", "image": object()}, "x"]}]] * b
    table = trl_group_table(
        outputs,
        RoundContext(
            step=3,
            rank=1,
            kind="train",
            group_size=4,
            reward_names=["a", "b"],
            reward_weights=[1.0, 1.0],
            eos_token_ids=[1],
            pad_token_id=0,
        ),
        RoundValues(
            prompts=chat,
            completions=[[{"role": "assistant", "content": f"c{i}"}] for i in range(b)],
        ),
        first_index=2,  # rows 2..5 of the generation batch: end of group 0, start of group 1
        rewards=torch.tensor([[1.0, math.nan]] * b),
    )
    assert table.column("group_id").to_pylist() == ["3.0.0", "3.0.1"]
    assert table.column("num_completions").to_pylist() == [2, 2]
    assert flat(table, "completion_index") == [2, 3, 0, 1]
    np.testing.assert_array_equal(
        np.array([x for c in flat(table, "sampling_token_logp") for x in c], np.float32),
        sampling[keep].numpy(),
    )
    assert flat(table, "sequence_importance_sampling_ratio") == pytest.approx(
        outputs["importance_sampling_ratio"][:, 0].tolist()
    )
    assert [len(m) for m in flat(table, "tool_mask")] == lengths
    assert [i["truncated"] for i in flat(table, "completion_info")] == [False, True, False, True]
    # The image object is dropped from the typed message, never stored.
    message = table.column("prompt_messages").to_pylist()[0][0]
    assert message["content"] is None and json.loads(message["extra"]) == {
        "content": [{"type": "image"}, "x"]
    }
    RolloutBatch(table.to_batches()[0], _row(table, 3, 1))  # a valid layout


def test_group_table_uses_given_lengths_when_trl_masks_truncated_rows():
    outputs = _outputs(2, 4, [4, 2])
    outputs["completion_mask"][0] = 0  # mask_truncated_completions zeroes a whole row
    context = RoundContext(
        step=0, rank=0, kind="train", group_size=2, reward_names=["r"], reward_weights=[1.0]
    )
    values = RoundValues(prompts=["p", "p"], completions=["x", "y"])
    table = trl_group_table(
        outputs,
        context,
        values,
        first_index=0,
        rewards=torch.zeros(2, 1),
        completion_lengths=[4, 2],
    )
    assert [len(c) for c in flat(table, "completion_ids")] == [4, 2]
    with pytest.raises(LayoutError, match="rewards: expected 2 columns"):
        trl_group_table(
            outputs,
            dataclasses.replace(context, reward_names=["r", "s"], reward_weights=[1.0, 1.0]),
            values,
            first_index=0,
            rewards=torch.zeros(2, 1),
        )


def _row(table: pa.Table, step: int, rank: int) -> pa.RecordBatch:
    return step_row(table, step=step, rank=rank, kind="train")


# ---------------------------------------------------------------------------- the example
@pytest.mark.slow
def test_the_trl_example_records_inspects_and_reports(tmp_path):
    script = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "format:          maxent-arrow-rollouts" in done.stdout  # maxent-arrow inspect
    assert "TRL's advantages recomputed" in done.stdout
    store = RolloutStore(tmp_path / "run" / "store")
    assert store.steps() == [0, 2] and store.verify().problems == []
    assert (tmp_path / "run" / "report" / "index.html").is_file()
    # Run again into the same directory: refused before any training step, nothing committed.
    entries = sorted(p.name for p in (tmp_path / "run" / "store" / "log").iterdir())
    again = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode != 0
    error = again.stderr.strip().splitlines()[-1]
    assert error.startswith("maxent_arrow.errors.StoreError:") and "refused" in error
    for choice in ("resume_from_checkpoint", "new run directory", "new_attempt"):
        assert choice in error
    assert "'loss'" in done.stdout and "'loss'" not in again.stdout  # no training step
    assert sorted(p.name for p in (tmp_path / "run" / "store" / "log").iterdir()) == entries


@pytest.mark.slow
def test_the_benchmark_quick_run_checks_itself(tmp_path):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_integrations.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for figure in ("TRL's completions Parquet", "pickle.dump + fsync", "torch.save", "floor"):
        assert figure in done.stdout


@pytest.mark.cuda
def test_group_table_from_gpu_tensors_equals_the_host_one():
    b, width, lengths = 4, 5, [5, 2, 3, 1]
    host = _outputs(b, width, lengths, ref_per_token_logps=torch.randn(b, width))
    device = {k: v.cuda() for k, v in host.items()}
    context = RoundContext(
        step=0,
        rank=0,
        kind="train",
        group_size=2,
        reward_names=["r"],
        reward_weights=[1.0],
        eos_token_ids=[1],
        pad_token_id=0,
    )
    values = RoundValues(prompts=["p"] * b, completions=["c"] * b)
    rewards = torch.ones(b, 1)
    assert trl_group_table(device, context, values, first_index=0, rewards=rewards).equals(
        trl_group_table(host, context, values, first_index=0, rewards=rewards)
    )


# ---------------------------------------------------------------------------- unscored (NaN)
@pytest.mark.slow
@pytest.mark.parametrize(
    "funcs",
    [["correct", "sometimes_none"], ["sometimes_none"]],
    ids=["one-of-two-returns-none", "the-only-function-returns-none"],
)
def test_unscored_completions_give_nan_free_figures_and_are_counted(tmp_path, funcs):
    """TRL turns a reward function's ``None`` into NaN and the store keeps it; every figure of
    the analytics and the report leaves those completions out and counts them as unscored,
    as TRL's own log (its completions Parquet) says."""
    probe = trl_runs.trainer(
        tmp_path,
        reward_funcs=[getattr(trl_runs, f) for f in funcs],
        max_steps=2,
        num_iterations=1,
        background=False,
    )
    probe.train()
    store = RolloutStore(tmp_path / "store")
    steps = store.steps()
    with RunAnalytics(store) as run:
        curve = run.reward_curve().to_pylist()
        success = run.success_rate(threshold=0.5).to_pylist()
        for step in steps:
            # TRL logs a round generated at global_step s as step s + 1.
            log = trl_parquet(tmp_path / "out", step + 1)
            values = log[funcs].to_numpy(dtype=np.float64)
            total = np.nansum(values, axis=1)
            total[np.isnan(values).all(axis=1)] = np.nan
            kept = total[~np.isnan(total)]
            row = next(r for r in curve if r["step"] == step and r["reward"] == "total_utils")
            assert row["unscored"] == int(np.isnan(total).sum())
            assert row["n"] == len(kept)
            if len(kept):
                assert row["mean"] == pytest.approx(kept.mean(), abs=1e-12)
                assert row["std"] == pytest.approx(kept.std(), abs=1e-12)  # population
            for j, name in enumerate(funcs):
                mine = next(r for r in curve if r["step"] == step and r["reward"] == name)
                assert mine["unscored"] == int(np.isnan(values[:, j]).sum())
                assert mine["unscored"] > 0 or name != "sometimes_none"
            avg = run.sql(
                f"SELECT avg(total_util) AS m, count(*) - count(total_util) AS u FROM samples "
                f"WHERE step = {step}"
            ).to_pylist()[0]
            assert avg["u"] == row["unscored"]
            assert (avg["m"] is None) == (len(kept) == 0)
            if len(kept):
                assert avg["m"] == pytest.approx(kept.mean(), abs=1e-12)
            s = next(r for r in success if r["step"] == step)
            assert s["unscored"] == row["unscored"] and s["num_samples"] == len(kept)
            extreme = run.extreme_completions(step, n=2).to_pylist()
            assert all(math.isfinite(r["score"]) for r in extreme)
            if len(kept):
                assert max(r["score"] for r in extreme) == pytest.approx(kept.max())
        for r in curve + success:
            for key, value in r.items():
                assert not (isinstance(value, float) and math.isnan(value)), (key, r)
    assert sum(r["unscored"] for r in curve if r["reward"] == "total_utils") > 0 or len(funcs) > 1
    report = build_report(store, tmp_path / "report", progress=False)
    flat_summary = json.dumps(report.summary, allow_nan=True)
    assert "NaN" not in flat_summary, flat_summary
