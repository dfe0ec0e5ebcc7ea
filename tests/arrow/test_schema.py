"""The group and step tables of schema 2.0, schema versions, unification across files, and
the upgrade of 1.x files."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from maxent_arrow import (
    AdvantageStats,
    BatchDiagnostics,
    PromptCompletionBatch,
    QDistribution,
    RewardComputation,
    RewardMoments,
    SchemaError,
    SchemaVersionError,
    StoreError,
)
from maxent_arrow.arrow import schema as S

# docs/arrow-layout.md, in order.
GROUP_COLUMNS = [
    "step",
    "rank",
    "kind",
    "group_index",
    "group_id",
    "group_size",
    "num_completions",
    "prompt",
    "prompt_messages",
    "answer",
    "prompt_ids",
    "completions",
    "completion_messages",
    "completion_index",
    "completion_ids",
    "completion_info",
    "ref_meta",
    "total_utils",
    "reward_names",
    "reward_values",
    "advantages",
    "q",
    "weights",
    "ref_logp_sum_raw",
    "ref_tok_counts",
    "ref_token_logp",
    "behavior_logp_sum",
    "behavior_token_logp",
    "policy_entropy_sum",
    "seed_semantic_entropy",
    "seed_advantage_scale",
    # Schema 2.1: the round of a step, the TRL and verl families' columns.
    "round",
    "token_advantages",
    "importance_sampling_ratio",
    "sequence_importance_sampling_ratio",
    "tool_mask",
    "sampling_token_logp",
    "token_returns",
    "token_values",
    "verl_row",
    "sample_prompt_ids",
    # The context of a rollout (issue 22): the dataset example it came from.
    "example_id",
    "stream_index",
    # Schema 2.2: the off-policy contract (issue 24).
    "completion_policy_version",
    "version_run_starts",
    "version_run_versions",
    "behavior_logp_semantics",
    "sampling_temperature",
    "sampling_top_p",
    "sampling_top_k",
    "sampling_min_p",
    "kept_token_ids",
    "topk_token_ids",
    "topk_token_logp",
]
# The layouts of runs by family: a TRL run carries no MaxEnt column, a MaxEnt run no TRL one.
MAXENT_ONLY = {
    "ref_meta",
    "q",
    "weights",
    "policy_entropy_sum",
    "seed_semantic_entropy",
    "seed_advantage_scale",
}


def list_of(kind: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", kind, nullable=False))


def test_group_schema_columns_types_and_non_null_children():
    schema = S.group_schema()
    assert schema.names == GROUP_COLUMNS
    assert schema.metadata[S.METADATA_KEY] == S.SCHEMA_VERSION.encode() == b"2.2"
    assert schema.field("step").type == pa.int64() and not schema.field("step").nullable
    for name in ("kind", "group_id"):
        assert schema.field(name).type == pa.string() and not schema.field(name).nullable
    for name in ("group_size", "num_completions"):
        assert schema.field(name).type == pa.int32() and not schema.field(name).nullable
    assert schema.field("completion_index").type == list_of(pa.int32())
    assert schema.field("prompt_messages").type == list_of(S.MESSAGE_TYPE)
    assert schema.field("completion_messages").type == list_of(list_of(S.MESSAGE_TYPE))
    assert S.MESSAGE_TYPE.names == ["role", "content", "extra"]
    assert schema.field("rank").type == pa.int32()
    assert schema.field("prompt_ids").type == list_of(pa.int32())
    assert schema.field("completions").type == list_of(pa.string())
    assert schema.field("completion_ids").type == list_of(list_of(pa.int32()))
    assert schema.field("ref_token_logp").type == list_of(list_of(pa.float32()))
    assert schema.field("ref_tok_counts").type == list_of(pa.int32())
    for name in ("total_utils", "advantages", "q", "weights", "behavior_logp_sum"):
        assert schema.field(name).type == list_of(pa.float64()), name
    info = schema.field("completion_info").type.value_type
    assert info == S.COMPLETION_INFO_TYPE
    assert info.names == ["finish_reason", "stop_reason", "truncated", "token_count", "extra"]
    assert schema.field("seed_semantic_entropy").type == pa.float64()
    # List children are non-nullable at every level (nulls defeat DLPack).
    for field in schema:
        kind = field.type
        while pa.types.is_list(kind):
            assert not kind.value_field.nullable, field.name
            kind = kind.value_type


def test_rewards_are_names_and_values_so_a_new_reward_changes_no_schema():
    schema = S.group_schema()
    names = schema.names
    assert names[names.index("total_utils") + 1 : names.index("total_utils") + 3] == [
        "reward_names",
        "reward_values",
    ]
    assert schema.field("reward_names").type == list_of(pa.string())
    assert schema.field("reward_values").type == list_of(list_of(pa.float64()))
    assert "rewards" not in names
    extra = S.group_schema(metadata={b"run": b"demo"}).metadata
    assert extra[b"run"] == b"demo" and extra[S.METADATA_KEY] == b"2.2"


def test_column_groups_are_consistent_with_the_schema():
    schema = S.group_schema()
    for name in S.PER_COMPLETION_COLUMNS:
        assert pa.types.is_list(schema.field(name).type), name
    for name in S.PER_TOKEN_COLUMNS:
        assert pa.types.is_list(schema.field(name).type.value_type), name
        assert name in S.PER_COMPLETION_COLUMNS
    assert set(S.GROUP_REQUIRED) <= set(schema.names)
    assert [f.name for f in S.GROUP_FIELDS] == GROUP_COLUMNS


def test_a_run_carries_the_columns_of_its_families_in_the_2_0_order():
    """The MaxEnt layout is exactly schema 2.0's columns in 2.0's order (files of a run
    written before and after 2.1 read alike); a TRL run's has no MaxEnt-only column and its
    own TRL columns; every layout has every core column."""
    maxent = S.group_schema(families=("core", "maxent")).names
    assert maxent == [
        *GROUP_COLUMNS[: GROUP_COLUMNS.index("token_advantages")],
        *GROUP_COLUMNS[GROUP_COLUMNS.index("example_id") :],  # later core columns: at the end
    ]
    assert maxent[: maxent.index("round")] == GROUP_COLUMNS[: GROUP_COLUMNS.index("round")]
    trl = S.group_schema(families=("core", "trl")).names
    assert not MAXENT_ONLY & set(trl)
    assert {"importance_sampling_ratio", "tool_mask", "token_advantages"} <= set(trl)
    assert "verl_row" not in trl
    core = S.group_schema(families=("core",)).names
    assert set(core) <= set(trl) and set(core) <= set(maxent)
    assert set(S.GROUP_REQUIRED) <= set(core)
    step_trl = S.step_schema(families=("core", "trl")).names
    assert "total_loss" not in step_trl and "reward_mean" in step_trl


def test_step_schema_holds_the_scalar_records_and_the_config():
    schema = S.step_schema()
    assert schema.metadata[S.METADATA_KEY] == b"2.2"
    assert set(S.STEP_REQUIRED) <= set(schema.names)
    scalar_fields = {
        "RewardMoments": ["reward_mean", "reward_std"],
        "LengthStats": [
            "min_length",
            "mean_length",
            "max_length",
            "clipped_ratio",
            "min_terminated",
            "mean_terminated",
            "max_terminated",
        ],
        "LossScalarBundle": [
            "total_loss",
            "policy_loss",
            "clip_loss",
            "kl_loss",
            "weighted_kl_loss",
        ],
        "ReferenceLogprobs": ["ref_logp_mean", "avg_completion_tokens"],
        "RewardComputation": [
            "entropy_bonus_scale",
            "seed_alpha_effective",
            "seed_max_possible_entropy",
        ],
    }
    for names in scalar_fields.values():
        for name in names:
            assert schema.field(name).type == pa.float64(), name
    import dataclasses

    for field in dataclasses.fields(BatchDiagnostics):
        # No map columns (HF datasets cannot read them): the bucket dicts are lists parallel
        # to kl_length_buckets.
        expected = list_of(pa.float64()) if field.name.endswith("_by_len_bucket") else pa.float64()
        assert schema.field(field.name).type == expected, field.name
    assert schema.field("kl_length_buckets").type == list_of(pa.string())
    assert not any(pa.types.is_map(f.type) for f in schema)
    assert schema.field("config").type == pa.string()
    assert schema.field("created_at").type == pa.timestamp("us", tz="UTC")


def test_kl_length_buckets_are_the_seed_labels():
    assert list(S.KL_LENGTH_BUCKETS) == ["0-32", "33-64", "65-128", "129-256", "257+"]
    assert list(S.KL_LENGTH_BUCKETS.values()) == [32, 64, 128, 256, None]


def test_schemas_survive_a_parquet_file(tmp_path):
    group = pa.Table.from_pylist(
        [
            {
                "step": 3,
                "rank": 0,
                "kind": "train",
                "group_index": 0,
                "group_id": "3.0.0",
                "group_size": 2,
                "num_completions": 2,
                "prompt": "2+2?",
                "completions": ["4", "5"],
                "completion_index": [0, 1],
                "completion_ids": [[52], [53, 1]],
                "reward_names": ["accuracy"],
                "reward_values": [[1.0], [0.0]],
                "completion_info": [
                    {"finish_reason": "stop", "token_count": 1},
                    {"finish_reason": "length", "truncated": True, "extra": json.dumps({"k": 1})},
                ],
            }
        ],
        schema=S.group_schema(),
    )
    pq.write_table(group, tmp_path / "group.parquet")
    back = pq.read_table(tmp_path / "group.parquet")
    assert back.schema.equals(group.schema, check_metadata=False)
    assert S.check_version(back.schema.metadata[S.METADATA_KEY], where="group.parquet") == "2.2"
    assert back.column("completion_ids").to_pylist() == [[[52], [53, 1]]]
    step = pa.Table.from_pylist(
        [{"step": 3, "rank": 0, "kind": "train", "num_groups": 1, "num_samples": 2}],
        schema=S.step_schema(),
    )
    pq.write_table(step, tmp_path / "step.parquet")
    assert pq.read_schema(tmp_path / "step.parquet").equals(S.step_schema(), check_metadata=False)


def test_record_columns_use_the_group_table_names_and_value_types():
    record = RewardComputation(
        total_utils=[1.0, 0.0],
        per_reward_values={"accuracy": [1.0, 0.0]},
        advantage=AdvantageStats([[1.0, -1.0]], [1.0, -1.0]),
        pairs=PromptCompletionBatch(["p", "p"], ["a", "b"]),
        q_distribution=QDistribution([[0.6, 0.4]], [0.6, 0.4]),
        moments=RewardMoments(0.5, 0.5),
    )
    batch = record.to_arrow()
    group = S.group_schema()
    for name in ("total_utils", "advantages", "q"):
        assert batch.schema.field(name).type.value_type == group.field(name).type.value_type


# ---------------------------------------------------------------------------- versions
@pytest.mark.parametrize("version", ["2.0", "2.7", b"2.0", "1.0", "0.3"])
def test_check_version_accepts_our_major_and_older(version):
    expected = version.decode() if isinstance(version, bytes) else version
    assert S.check_version(version, where="a.parquet") == expected


def test_check_version_refuses_a_newer_major_missing_and_malformed_versions():
    with pytest.raises(
        SchemaVersionError,
        match=r"^part-0\.parquet: written with schema version 3\.0, newer than this "
        r"maxent-arrow reads \(2\.2\); upgrade maxent-arrow$",
    ):
        S.check_version("3.0", where="part-0.parquet")
    with pytest.raises(SchemaVersionError, match="^x: no schema version in the metadata$"):
        S.check_version(None, where="x")
    with pytest.raises(SchemaVersionError, match="^x: malformed schema version 'one.0'$"):
        S.check_version("one.0", where="x")
    assert issubclass(SchemaVersionError, StoreError)


# ---------------------------------------------------------------------------- unify_schemas
def test_a_reward_added_mid_run_keeps_every_file_schema_and_plain_readers_see_it(tmp_path):
    def rows(step, names, values):
        return pa.Table.from_pylist(
            [
                {
                    "step": step,
                    "rank": 0,
                    "kind": "train",
                    "group_index": 0,
                    "group_id": f"{step}.0.0",
                    "group_size": 1,
                    "num_completions": 1,
                    "completions": ["x"],
                    "reward_names": names,
                    "reward_values": [values],
                }
            ],
            schema=S.group_schema(),
        )

    pq.write_table(rows(1, ["accuracy"], [1.0]), tmp_path / "step-1.parquet")
    pq.write_table(rows(2, ["accuracy", "format"], [0.0, 1.0]), tmp_path / "step-2.parquet")
    schemas = [pq.read_schema(tmp_path / f) for f in ("step-1.parquet", "step-2.parquet")]
    assert schemas[0].equals(schemas[1], check_metadata=False)
    unified = S.unify_schemas(schemas)
    assert unified.metadata[S.METADATA_KEY] == b"2.2"
    # A plain pyarrow dataset (first file's schema) keeps the second reward.
    table = ds.dataset(tmp_path, format="parquet").to_table().sort_by("step")
    assert table.column("reward_names").to_pylist() == [["accuracy"], ["accuracy", "format"]]
    assert table.column("reward_values").to_pylist() == [[[1.0]], [[0.0, 1.0]]]
    plus = S.unify_schemas([S.group_schema(), pa.schema([("weights_v2", pa.float64())])])
    assert plus.names[-1] == "weights_v2"
    missing = S.unify_schemas([S.group_schema(), pa.schema([("q", pa.null())])])
    assert missing.field("q").type == list_of(pa.float64())


def test_unify_still_merges_struct_fields_of_other_writers():
    a = pa.schema([("extra", pa.struct([("a", pa.float64())]))])
    b = pa.schema([("extra", pa.struct([("a", pa.float64()), ("b", pa.string())]))])
    assert S.unify_schemas([a, b]).field("extra").type.names == ["a", "b"]


def test_unify_accepts_lossless_spellings_of_the_same_type():
    ours = pa.schema([("q", list_of(pa.float64())), ("prompt", pa.string())])
    duckdb_style = pa.schema(
        [("q", pa.list_(pa.field("element", pa.float64()))), ("prompt", pa.large_string())]
    )
    large = pa.schema([("q", pa.large_list(pa.float64()))])
    unified = S.unify_schemas([ours, duckdb_style, large])
    assert unified.field("q").type.value_type == pa.float64()


@pytest.mark.parametrize(
    "changed, message",
    [
        (
            pa.schema([("advantages", pa.list_(pa.float32()))]),
            "store: column 'advantages' changed type from list<item: double not null> to "
            "list<item: float>",
        ),
        (
            pa.schema([("reward_values", pa.list_(pa.list_(pa.int64())))]),
            "store: column 'reward_values' changed type from list<item: list<item: double not "
            "null> not null> to list<item: list<item: int64>>",
        ),
        (
            pa.schema([("seed_semantic_entropy", pa.string())]),
            "store: column 'seed_semantic_entropy' changed type from double to string",
        ),
    ],
)
def test_unify_refuses_a_type_change_by_column(changed, message):
    with pytest.raises(SchemaError, match="^" + re.escape(message) + "$"):
        S.unify_schemas([S.group_schema(), changed])


def test_unify_refuses_a_changed_primitive_and_no_input():
    with pytest.raises(
        SchemaError, match="^runs/a: column 'step' changed type from int64 to string$"
    ):
        S.unify_schemas([S.group_schema(), pa.schema([("step", pa.string())])], where="runs/a")
    with pytest.raises(SchemaError, match="^store: no schemas to unify$"):
        S.unify_schemas([])
