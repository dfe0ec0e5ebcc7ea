"""RolloutBatch: assembly from the seed objects, the seed objects back, Arrow round trips,
the PyCapsule stream protocol, and refusal of bad input."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from maxent_arrow import (
    GenerationBatch,
    LayoutError,
    RewardComputation,
    RolloutBatch,
    RolloutStore,
    SchemaError,
)
from maxent_arrow.arrow.schema import group_schema, step_schema
from maxent_arrow.testing import CONFIG, make_parts
from maxent_arrow.types import records_equal


@pytest.fixture
def parts():
    return make_parts(seed=7, groups=4)


@pytest.fixture
def batch(parts):
    return RolloutBatch.from_parts(12, rank=3, **parts)


def test_identity_and_counts(batch, parts):
    gen = parts["generation"]
    assert (batch.step, batch.rank, batch.kind) == (12, 3, "train")
    assert batch.num_groups == len(gen.prompts) == len(batch) == 4
    assert batch.num_samples == sum(len(g) for g in gen.grouped_completions)
    assert batch.config == CONFIG
    assert batch.groups.column("step").to_pylist() == [12] * 4
    assert batch.groups.column("group_index").to_pylist() == [0, 1, 2, 3]
    assert "step=12" in repr(batch)


def test_layout_is_the_current_schema(batch):
    expected = group_schema()
    for f in batch.groups.schema:
        assert f.type == expected.field(f.name).type, f.name
    steps = step_schema()
    for f in batch.step_row.schema:
        assert f.type == steps.field(f.name).type, f.name


def test_seed_objects_come_back_equal(batch, parts):
    assert batch.generation_batch == parts["generation"]
    rc, given_rc = batch.reward_computation, parts["rewards"]
    assert rc.total_utils == given_rc.total_utils
    assert rc.per_reward_values == given_rc.per_reward_values
    assert rc.advantage == given_rc.advantage
    assert rc.q_distribution == given_rc.q_distribution
    assert rc.moments == given_rc.moments
    assert rc.pairs.prompts == given_rc.pairs.prompts
    assert rc.pairs.completions == given_rc.pairs.completions
    assert records_equal(batch.reference_logprobs, parts["reference"])  # tensors
    assert batch.length_stats == parts["length_stats"]
    assert batch.loss_scalars == parts["loss"]
    assert batch.diagnostics == parts["diagnostics"]
    assert records_equal(batch.score_batch(slice_size=4), parts["score_batch"])


def test_behaviour_logprobs_and_weights_regrouped(batch, parts):
    offsets = batch.group_offsets
    scores = parts["scores"]
    mask = scores.token_mask.bool()
    behaviour = batch.ragged("behavior_token_logp")
    assert torch.equal(behaviour.values, scores.old_token_logp[mask])
    assert torch.equal(behaviour.lengths(), mask.sum(1))
    got = batch.column("behavior_logp_sum")
    assert np.array_equal(np.asarray(got.offsets)[[0, -1]], [0, offsets[-1]])
    assert np.allclose(got.flatten().to_numpy(), scores.behavior_logp_sum.double().numpy())
    assert np.array_equal(batch.column("weights").flatten().to_numpy(), parts["weights"].numpy())


def test_flat_columns_are_regrouped_without_copy(parts):
    weights = parts["weights"]  # float64 tensor: Arrow views it, regrouping adds offsets only
    # An Arrow-born RewardComputation (what compute_rewards returns): its buffers are reused.
    rewards = RewardComputation.from_arrow(parts["rewards"].to_arrow())
    batch = RolloutBatch.from_parts(0, **{**parts, "rewards": rewards})
    values = batch.column("weights").flatten()
    assert values.buffers()[1].address == weights.data_ptr()
    advantages = rewards.advantage.column("grouped").flatten()
    assert batch.column("advantages").flatten().buffers()[1].address == (
        advantages.buffers()[1].address + advantages.offset * 8
    )


def test_token_ids_from_completion_info_without_score_batch(parts):
    gen = parts["generation"]
    ids = parts["score_batch"].completion_ids
    mask = parts["score_batch"].completion_attention_mask.bool()
    rows = [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]
    offsets = np.cumsum([0] + [len(g) for g in gen.grouped_completions])
    info = [
        [
            dict(gen.grouped_completion_info[g][k], token_ids=rows[offsets[g] + k])
            for k in range(len(c))
        ]
        for g, c in enumerate(gen.grouped_completions)
    ]
    gen2 = GenerationBatch(gen.prompts, gen.answers, gen.grouped_completions, None, info)
    batch = RolloutBatch.from_parts(1, generation=gen2)
    assert batch.ragged("completion_ids").tolist() == rows
    assert batch.generation_batch == gen2  # token_ids put back into the info dicts
    assert "prompt_ids" not in batch.groups.schema.names
    assert batch.reward_computation is None and batch.reference_logprobs is None
    assert batch.length_stats is None and batch.loss_scalars is None


def test_differing_info_token_ids_are_kept(parts):
    gen = parts["generation"]
    info = [[dict(d, token_ids=[1, 2, 3]) for d in group] for group in gen.grouped_completion_info]
    gen2 = GenerationBatch(gen.prompts, gen.answers, gen.grouped_completions, None, info)
    batch = RolloutBatch.from_parts(1, generation=gen2, score_batch=parts["score_batch"])
    assert batch.generation_batch == gen2
    assert batch.ragged("completion_ids").lengths().tolist() != [3] * batch.num_samples


def test_to_arrow_from_arrow_round_trips(batch, tmp_path):
    table = batch.to_arrow()
    assert table.num_rows == batch.num_groups
    assert RolloutBatch.from_arrow(table).equals(batch)
    pq.write_table(table, tmp_path / "b.parquet")
    back = RolloutBatch.from_arrow(pq.read_table(tmp_path / "b.parquet"))
    assert back.equals(batch)
    assert records_equal(back.reference_logprobs, batch.reference_logprobs)
    with ipc.new_file(tmp_path / "b.arrow", table.schema) as writer:
        writer.write_table(table)
    mapped = ipc.open_file(pa.memory_map(str(tmp_path / "b.arrow"))).read_all()
    assert RolloutBatch.from_arrow(mapped).equals(batch)


def test_from_arrow_without_step_row_is_refused(batch):
    with pytest.raises(SchemaError, match="no step row"):
        RolloutBatch.from_arrow(pa.Table.from_batches([batch.groups]))


def test_pycapsule_stream_protocol(batch):
    import duckdb
    import polars as pl

    rows = duckdb.sql("SELECT step, group_index, len(completions) AS k FROM batch").fetchall()
    sizes = np.diff(batch.group_offsets).tolist()
    assert rows == [(12, g, sizes[g]) for g in range(4)]
    frame = pl.DataFrame(batch)
    assert frame.shape == (4, len(batch.groups.schema))
    assert frame["prompt"].to_list() == batch.column("prompt").to_pylist()
    assert pa.table(batch).equals(batch.to_arrow())
    reader = pa.RecordBatchReader.from_stream(batch)
    assert reader.read_all().num_rows == 4


def test_mismatched_group_sizes_name_the_group(parts):
    rewards = parts["rewards"]
    bad = dataclasses.replace(parts["generation"])
    groups = [list(g) for g in bad.grouped_completions]
    groups[2] = groups[2] + ["extra completion"]
    gen = GenerationBatch(bad.prompts, bad.answers, groups, None, None)
    with pytest.raises(LayoutError, match="group 2"):
        RolloutBatch.from_parts(0, generation=gen, rewards=rewards)


def test_wrong_weights_length_is_refused(parts):
    with pytest.raises(LayoutError, match="weights"):
        RolloutBatch.from_parts(0, generation=parts["generation"], weights=[0.5, 0.5])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kind": "../x"}, SchemaError, "kind"),
        ({"kind": "Train"}, SchemaError, "kind"),
        ({"rank": -1}, LayoutError, "rank"),
        ({"config": {"tokenizer": object()}}, SchemaError, "config"),
        ({"rewards": "not a RewardComputation"}, SchemaError, "rewards"),
    ],
)
def test_bad_arguments_are_refused(parts, kwargs, error, match):
    with pytest.raises(error, match=match):
        RolloutBatch.from_parts(0, generation=parts["generation"], **kwargs)


def test_negative_step_is_refused(parts):
    with pytest.raises(LayoutError, match="step"):
        RolloutBatch.from_parts(-1, generation=parts["generation"])


def test_constructor_checks_the_layout(batch):
    groups, row = batch.groups, batch.step_row
    steps = pa.array([12, 12, 13, 12], pa.int64())
    bad = groups.set_column(groups.schema.get_field_index("step"), "step", steps)
    with pytest.raises(LayoutError, match="group 2"):
        RolloutBatch(bad, row)
    wrong = row.set_column(
        row.schema.get_field_index("num_samples"), "num_samples", pa.array([1], pa.int32())
    )
    with pytest.raises(LayoutError, match="num_samples"):
        RolloutBatch(groups, wrong)
    q = groups.column("q")
    short = pa.ListArray.from_arrays(
        pa.array(np.r_[np.asarray(q.offsets)[:-1], np.asarray(q.offsets)[-1] - 1].astype(np.int32)),
        q.flatten().slice(0, len(q.flatten()) - 1),
    )
    with pytest.raises(LayoutError, match="'q'.*group 3"):
        RolloutBatch(groups.set_column(groups.schema.get_field_index("q"), "q", short), row)
    with pytest.raises(SchemaError, match="missing required column 'completions'"):
        RolloutBatch(groups.drop_columns(["completions"]), row)
    typed = groups.set_column(0, "step", pa.array(["x"] * 4))
    with pytest.raises(SchemaError, match="'step'"):
        RolloutBatch(typed, row)


def test_two_groups_of_one_append_with_one_group_index_are_refused(batch, tmp_path):
    """Fault probe F02: a lifecycle record addresses a group by (step, rank, kind,
    group_index); two groups of one append sharing an index would be dropped (and counted)
    as one, so the batch is refused, naming the index and its rows, and nothing is written."""
    groups, row = batch.groups, batch.step_row
    where = groups.schema.get_field_index("group_index")
    twice = groups.set_column(where, "group_index", pa.array([0, 1, 1, 3], pa.int32()))
    with pytest.raises(LayoutError, match=r"group_index 1 at groups \[1, 2\]"):
        RolloutBatch(twice, row)
    store = RolloutStore.create(tmp_path / "s")
    before = sorted((tmp_path / "s").rglob("*"))
    with pytest.raises(LayoutError, match="group_index"):
        store.append(RolloutBatch(twice, row))
    assert store.steps() == [] and sorted((tmp_path / "s").rglob("*")) == before


@given(
    seed=st.integers(0, 10_000),
    groups=st.integers(1, 6),
    k=st.tuples(st.integers(1, 3), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1])),
)
def test_parquet_round_trip_property(tmp_path_factory, seed, groups, k):
    parts = make_parts(seed=seed, groups=groups, k=k)
    batch = RolloutBatch.from_parts(seed, **parts)
    path = tmp_path_factory.mktemp("rt") / "b.parquet"
    pq.write_table(batch.to_arrow(), path)
    back = RolloutBatch.from_arrow(pq.read_table(path))
    assert back.equals(batch)
    assert back.generation_batch == parts["generation"]
    assert records_equal(back.reference_logprobs, parts["reference"])
    assert json.loads(back.step_row.column("config")[0].as_py()) == CONFIG


def test_objects_built_the_original_way_come_back_from_parquet_equal(parts, tmp_path):
    batch = RolloutBatch.from_parts(5, rank=1, **parts)
    pq.write_table(batch.to_arrow(), tmp_path / "step.parquet")
    back = RolloutBatch.from_arrow(pq.read_table(tmp_path / "step.parquet"))
    gen, given_gen = back.generation_batch, parts["generation"]
    assert gen == given_gen
    assert isinstance(gen.prompts, list) and isinstance(gen.grouped_completions[0], list)
    assert all(isinstance(group, list) for group in gen.grouped_ref_meta)
    rc, given = back.reward_computation, parts["rewards"]
    for field in ("total_utils", "per_reward_values", "advantage", "q_distribution", "moments"):
        assert getattr(rc, field) == getattr(given, field), field
    assert rc.pairs.prompts == given.pairs.prompts
    assert rc.pairs.completions == given.pairs.completions
    flat_info = [info for group in given_gen.grouped_completion_info for info in group]
    assert rc.completion_metadata is rc.pairs.metadata and rc.completion_metadata == flat_info
    assert isinstance(rc.total_utils, list) and isinstance(rc.per_reward_values["format"], list)
    assert records_equal(back.reference_logprobs, parts["reference"])
    assert back.length_stats == parts["length_stats"]
    assert back.loss_scalars == parts["loss"]
    assert back.diagnostics == parts["diagnostics"]
    assert records_equal(back.score_batch(slice_size=4), parts["score_batch"])
    # Arrow-born: an untouched object gives its batch back, and views the step's buffers.
    fresh = back.generation_batch
    assert fresh.to_arrow() is fresh.to_arrow()
    stored = back.groups.column("completions")
    assert fresh.column("completions").buffers() == stored.buffers()
    assert back.reward_computation.tensor("total_utils").data_ptr() == (
        back.column("total_utils").flatten().buffers()[1].address
    )
    # The replayed objects assemble the same group rows again.
    again = RolloutBatch.from_parts(
        5,
        rank=1,
        generation=back.generation_batch,
        rewards=back.reward_computation,
        reference=back.reference_logprobs,
        score_batch=back.score_batch(slice_size=4),
        length_stats=back.length_stats,
        loss=back.loss_scalars,
        diagnostics=back.diagnostics,
        weights=back.column("weights"),
        config=back.config,
    )
    for name in again.groups.schema.names:
        assert again.groups.column(name).equals(batch.groups.column(name)), name


def test_chat_prompts_and_completions_in_the_message_columns(parts, tmp_path):
    from maxent_arrow.compute import compute_rewards

    chat = [{"role": "user", "content": "What is 2+2?"}]
    gen = GenerationBatch(
        prompts=["plain prompt", chat],
        answers=["a", "4"],
        grouped_completions=[
            ["x", "y"],
            [[{"role": "assistant", "content": "4", "tool_calls": []}], [{"role": "assistant"}]],
        ],
        grouped_ref_meta=None,
    )
    rewards = compute_rewards(
        gen,
        [lambda completions, answers: [float(isinstance(c, list)) for c in completions]],
        weights=[1.0],
    )
    assert rewards.per_reward_values["reward_0"] == [0.0, 0.0, 1.0, 1.0]  # messages, as given
    batch = RolloutBatch.from_parts(0, generation=gen, rewards=rewards)
    groups = batch.groups
    assert groups.column("prompt").to_pylist() == ["plain prompt", None]
    assert groups.column("prompt_messages")[1].as_py()[0]["content"] == "What is 2+2?"
    assert groups.column("completions").to_pylist() == [["x", "y"], ["4", ""]]
    assert groups.column("completion_messages").to_pylist()[0] is None
    pq.write_table(batch.to_arrow(), tmp_path / "chat.parquet")
    back = RolloutBatch.from_arrow(pq.read_table(tmp_path / "chat.parquet"))
    assert back.generation_batch == gen
    assert back.reward_computation.pairs.prompts == ["plain prompt"] * 2 + [chat] * 2
    assert back.reward_computation.pairs.completions == rewards.pairs.completions


def test_a_group_with_both_prompt_columns_is_refused():
    chat = [{"role": "user", "content": "hi"}]
    gen = GenerationBatch(["plain", chat], ["a", "b"], [["x"], ["y"]], None)
    batch = RolloutBatch.from_parts(0, generation=gen)
    groups = batch.groups
    both = groups.set_column(
        groups.schema.get_field_index("prompt"), "prompt", pa.array(["plain", "text too"])
    )
    with pytest.raises(LayoutError, match="group 1 has both; a prompt is text or chat"):
        RolloutBatch(both, batch.step_row)
