"""Python -> Arrow -> (Parquet file | IPC file) -> Arrow -> Python round trips of every data class.

Hypothesis draws the awkward cases: empty groups, K = 1, unequal K, zero groups, unicode text,
NaN and infinities, None optionals, free-form JSON metadata, low-precision tensors.
"""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maxent_arrow import (
    AdvantageStats,
    BatchDiagnostics,
    GenerationBatch,
    LengthStats,
    LossOutputs,
    LossScalarBundle,
    PromptCacheEntry,
    PromptCompletionBatch,
    QDistribution,
    ReferenceLogprobs,
    RewardComputation,
    RewardMoments,
    ScoreBatch,
    SequenceScores,
)
from maxent_arrow.types import records_equal

EXAMPLES = settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])

floats = st.floats(allow_nan=True, allow_infinity=True)
opt_floats = st.none() | floats
texts = st.text(max_size=6)  # any unicode but lone surrogates (not encodable as UTF-8)
token_ids = st.integers(min_value=0, max_value=2**31 - 1)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | floats | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
group_sizes = st.lists(st.integers(0, 4), max_size=5)  # empty groups, K = 1, unequal K


@st.composite
def completion_info(draw) -> dict:
    """A completion-info dict: the typed keys (sometimes with odd values) plus extra JSON keys."""
    info = {}
    if draw(st.booleans()):
        info["finish_reason"] = draw(st.sampled_from(["stop", "length", "abort"]) | st.none())
    if draw(st.booleans()):
        info["truncated"] = draw(st.booleans())
    if draw(st.booleans()):
        info["token_count"] = draw(st.integers(0, 10**6) | st.floats(0, 10))
    if draw(st.booleans()):
        info["token_ids"] = draw(st.lists(token_ids, max_size=5))
    if draw(st.booleans()):
        info["stop_reason"] = draw(texts)
    info.update(draw(st.dictionaries(texts, json_values, max_size=2)))
    return info


def grouped_of(sizes: list[int], items) -> st.SearchStrategy:
    return st.tuples(*[st.lists(items, min_size=k, max_size=k) for k in sizes]).map(list)


def flatten(groups) -> list:
    return [x for g in groups for x in g]


# ---------------------------------------------------------------------------- strategies
@st.composite
def generation_batches(draw) -> GenerationBatch:
    sizes = draw(group_sizes)
    return GenerationBatch(
        prompts=draw(st.lists(texts, min_size=len(sizes), max_size=len(sizes))),
        answers=draw(st.lists(texts, min_size=len(sizes), max_size=len(sizes))),
        grouped_completions=draw(grouped_of(sizes, texts)),
        grouped_ref_meta=draw(st.none() | grouped_of(sizes, json_values)),
        grouped_completion_info=draw(st.none() | grouped_of(sizes, completion_info())),
    )


@st.composite
def pair_batches(draw, n: int | None = None) -> PromptCompletionBatch:
    n = draw(st.integers(0, 6)) if n is None else n
    return PromptCompletionBatch(
        prompts=draw(st.lists(texts, min_size=n, max_size=n)),
        completions=draw(st.lists(texts, min_size=n, max_size=n)),
        metadata=draw(st.none() | st.lists(completion_info(), min_size=n, max_size=n)),
    )


@st.composite
def grouped_pairs(draw, cls, sizes: list[int] | None = None):
    sizes = draw(group_sizes) if sizes is None else sizes
    groups = draw(grouped_of(sizes, floats))
    return cls(grouped=groups, samples=flatten(groups))


@st.composite
def reward_computations(draw) -> RewardComputation:
    sizes = draw(group_sizes)
    n, p = sum(sizes), len(sizes)
    pairs = draw(pair_batches(n))
    keys = draw(st.lists(texts, max_size=3, unique=True))
    metadata = draw(
        st.sampled_from(["none", "pairs", "own"]) if pairs.metadata is not None else st.just("none")
    )
    return RewardComputation(
        total_utils=draw(st.lists(floats, min_size=n, max_size=n)),
        per_reward_values={k: draw(st.lists(floats, min_size=n, max_size=n)) for k in keys},
        advantage=draw(grouped_pairs(AdvantageStats, sizes)),
        pairs=pairs,
        q_distribution=draw(grouped_pairs(QDistribution, sizes)),
        moments=RewardMoments(mean=draw(floats), std=draw(floats)),
        ref_logprob_meta=draw(st.none() | st.lists(json_values, min_size=n, max_size=n)),
        completion_metadata={
            "none": None,
            "pairs": pairs.metadata,
            "own": draw(st.lists(completion_info(), min_size=n, max_size=n)),
        }[metadata],
        entropy_bonus_scale=draw(opt_floats),
        seed_semantic_entropies=draw(st.none() | st.lists(floats, min_size=p, max_size=p)),
        seed_advantage_scales=draw(st.none() | st.lists(floats, min_size=p, max_size=p)),
        seed_alpha_effective=draw(opt_floats),
        seed_max_possible_entropy=draw(opt_floats),
    )


def float_tensor(draw, shape, dtype) -> torch.Tensor:
    size = math.prod(shape)
    values = draw(st.lists(floats, min_size=size, max_size=size))
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


def prefix_mask(draw, rows: int, width: int) -> torch.Tensor:
    lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    return torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.int64).reshape(-1, 1)


float_dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])


@st.composite
def score_batches(draw) -> ScoreBatch:
    n, width = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    pad = draw(st.integers(0, 500))
    mask = prefix_mask(draw, n, width)
    ids = torch.tensor(
        draw(st.lists(token_ids, min_size=n * width, max_size=n * width)), dtype=torch.int64
    )
    ids = torch.where(mask, ids.reshape(n, width), pad)
    prompts = [
        PromptCacheEntry(ids, [1] * len(ids))
        for ids in draw(st.lists(st.lists(token_ids, max_size=4), min_size=n, max_size=n))
    ]
    return ScoreBatch(
        prompt_entries=prompts,
        completion_ids=ids,
        completion_attention_mask=mask.to(draw(st.sampled_from([torch.int64, torch.int32]))),
        pad_token_id=pad,
        max_prompt_len=draw(st.integers(0, 4096)),
        slice_size=draw(st.integers(1, 64)),
        total_sequences=n,
        score_tail_tokens=draw(st.none() | st.integers(0, 64)),
    )


@st.composite
def sequence_scores(draw) -> SequenceScores:
    n, width = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    dtype = draw(float_dtypes)

    def vector():
        return float_tensor(draw, (n,), dtype)

    def optional(build):
        return build() if draw(st.booleans()) else None

    mask = optional(lambda: prefix_mask(draw, n, width))

    def per_token():
        values = float_tensor(draw, (n, width), torch.float32)
        # Entries off the mask are not stored and come back as 0 (NaN * 0 would stay NaN).
        return values if mask is None else torch.where(mask, values, 0.0)

    token_logp = optional(per_token)
    return SequenceScores(
        cur_logp_sum=vector(),
        behavior_logp_sum=vector(),
        log_ratio_train=vector(),
        denom_tok_tensor=vector(),
        pooled_hidden=optional(lambda: float_tensor(draw, (n, 3), dtype)),
        policy_entropy_sum=optional(vector),
        token_logp=token_logp,
        token_mask=None
        if mask is None
        else mask.to(draw(st.sampled_from([torch.float32, torch.int64]))),
        old_token_logp=optional(per_token),
    )


@st.composite
def reference_logprobs(draw) -> ReferenceLogprobs:
    n, width = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    dtype = draw(float_dtypes)
    token_logp = mask = None
    if draw(st.booleans()):
        token_logp = float_tensor(draw, (n, width), draw(float_dtypes))
        if draw(st.booleans()):
            mask = prefix_mask(draw, n, width)
            token_logp = torch.where(mask, token_logp, 0.0)
            mask = mask.to(torch.int64)
    counts = draw(st.sampled_from([torch.float32, torch.int64]))
    return ReferenceLogprobs(
        ref_logp_sum=float_tensor(draw, (n,), dtype),
        ref_tok_counts=torch.tensor(
            draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n)), dtype=counts
        ),
        ref_logp_sum_raw=float_tensor(draw, (n,), dtype),
        ref_logp_mean=draw(floats),
        avg_completion_tokens=draw(floats),
        ref_token_logp=token_logp,
        ref_token_mask=mask,
    )


loss_bundles = st.builds(LossScalarBundle, floats, floats, opt_floats, floats, floats)


@st.composite
def loss_outputs(draw) -> LossOutputs:
    n = draw(st.integers(0, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    return LossOutputs(
        loss=float_tensor(draw, (), dtype).requires_grad_(),
        scalars=draw(loss_bundles),
        log_ratio_train=float_tensor(draw, (n,), dtype),
        denom_tok_tensor=float_tensor(draw, (n,), torch.float32),
    )


@st.composite
def prompt_entries(draw) -> PromptCacheEntry:
    ids = draw(st.lists(token_ids, max_size=6))
    return PromptCacheEntry(
        ids, draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
    )


buckets = st.dictionaries(st.sampled_from(["0-32", "33-64", "65-128", "129-256", "257+"]), floats)

STRATEGIES = {
    "PromptCacheEntry": prompt_entries(),
    "GenerationBatch": generation_batches(),
    "PromptCompletionBatch": pair_batches(),
    "AdvantageStats": grouped_pairs(AdvantageStats),
    "QDistribution": grouped_pairs(QDistribution),
    "RewardMoments": st.builds(RewardMoments, floats, floats),
    "RewardComputation": reward_computations(),
    "ScoreBatch": score_batches(),
    "SequenceScores": sequence_scores(),
    "ReferenceLogprobs": reference_logprobs(),
    "LossScalarBundle": loss_bundles,
    "LossOutputs": loss_outputs(),
    "LengthStats": st.builds(LengthStats, *[floats] * 7),
    "BatchDiagnostics": st.builds(BatchDiagnostics, opt_floats, *[floats] * 6, buckets, buckets),
}


# ---------------------------------------------------------------------------- round trips
def check_round_trips(record, parquet_roundtrip, ipc_roundtrip) -> None:
    cls = type(record)
    batch = record.to_arrow()
    assert isinstance(batch, pa.RecordBatch)
    inputs = [batch, parquet_roundtrip(batch), ipc_roundtrip(batch)]
    if batch.num_rows >= 2:  # a table of several chunks (as a dataset scan returns)
        inputs.append(pa.Table.from_batches([batch.slice(0, 1), batch.slice(1)]))
    for data in inputs:
        back = cls.from_arrow(data)
        assert type(back) is cls
        assert records_equal(back, record), (data.schema, back, record)
        assert back.to_arrow().to_pylist() is not None  # the result converts again


def test_every_data_class_has_a_strategy():
    from maxent_arrow.types import rewards

    assert sorted(STRATEGIES) == sorted(set(rewards.__all__) - {"ValidationContext"})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_round_trip_through_arrow_parquet_and_ipc(name, parquet_roundtrip, ipc_roundtrip):
    @EXAMPLES
    @given(STRATEGIES[name])
    def run(record):
        check_round_trips(record, parquet_roundtrip, ipc_roundtrip)

    run()


def test_round_trip_keeps_tensor_dtypes_shapes_and_widths(parquet_roundtrip):
    scores = SequenceScores(
        cur_logp_sum=torch.tensor([-1.0, float("nan")], dtype=torch.bfloat16),
        behavior_logp_sum=torch.tensor([float("-inf"), 0.0], dtype=torch.float16),
        log_ratio_train=torch.zeros(2, dtype=torch.float64),
        denom_tok_tensor=torch.ones(2),
        token_logp=torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0]]),
        token_mask=torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]),
    )
    back = SequenceScores.from_arrow(parquet_roundtrip(scores.to_arrow()))
    assert back.cur_logp_sum.dtype == torch.bfloat16 and math.isnan(float(back.cur_logp_sum[1]))
    assert back.behavior_logp_sum.dtype == torch.float16
    assert back.token_logp.shape == (2, 4) and back.token_mask.dtype == torch.float32
    assert back.token_mask.tolist() == scores.token_mask.tolist()
    assert records_equal(back, scores)


def test_per_token_tensors_are_stored_ragged_by_the_mask():
    batch = ScoreBatch(
        prompt_entries=[PromptCacheEntry([1], [1]), PromptCacheEntry([2, 3], [1, 1])],
        completion_ids=torch.tensor([[7, 8, 9, 0, 0], [5, 0, 0, 0, 0]]),
        completion_attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]),
        pad_token_id=0,
        max_prompt_len=8,
        slice_size=1,
        total_sequences=2,
    )
    arrow = batch.to_arrow()
    assert arrow.column("completion_ids").to_pylist() == [[7, 8, 9], [5]]
    assert pa.types.is_list(arrow.column("completion_ids").type)
    back = ScoreBatch.from_arrow(arrow)
    assert back.completion_ids.dtype == torch.int64 and back.completion_ids.shape == (2, 5)
    assert records_equal(back, batch)


def test_scalar_classes_are_one_row_batches():
    record = BatchDiagnostics(None, 0.1, 0.0, 0.0, 0.1, 1.0, 0.1, {"0-32": 0.5}, {"0-32": 40.0})
    batch = record.to_arrow()
    assert batch.num_rows == 1 and batch.column("kl_value").null_count == 1
    assert batch.column("kl_per_token_by_len_bucket").to_pylist() == [[("0-32", 0.5)]]
    assert RewardMoments.from_arrow(RewardMoments(1.0, 2.0).to_arrow()) == RewardMoments(1.0, 2.0)


def test_group_classes_are_one_row_per_group_with_the_group_table_names():
    record = RewardComputation(
        total_utils=[1.0, 0.0, 0.5],
        per_reward_values={"accuracy": [1.0, 0.0, 0.5], "format": [0.0, 0.0, 1.0]},
        advantage=AdvantageStats([[1.0, -1.0], [0.0]], [1.0, -1.0, 0.0]),
        pairs=PromptCompletionBatch(["p", "p", "q"], ["a", "b", "c"]),
        q_distribution=QDistribution([[0.7, 0.3], [1.0]], [0.7, 0.3, 1.0]),
        moments=RewardMoments(0.5, 0.4),
        seed_semantic_entropies=[0.1, 0.0],
    )
    batch = record.to_arrow()
    assert batch.num_rows == 2
    assert batch.column("advantages").to_pylist() == [[1.0, -1.0], [0.0]]
    assert batch.column("rewards").type.names == ["accuracy", "format"]
    assert batch.column("seed_semantic_entropy").to_pylist() == [0.1, 0.0]
    back = RewardComputation.from_arrow(batch)
    assert list(back.per_reward_values) == ["accuracy", "format"]
    assert back == record
    changed = dataclasses.replace(record, total_utils=[0.0, 0.0, 0.0])
    assert RewardComputation.from_arrow(changed.to_arrow()) != record


# ---------------------------------------------------------------------------- edits, then Arrow
def mutate(record, data) -> None:
    """An edit the trainer could make in place (keeping the record storable)."""
    draw = data.draw
    name = type(record).__name__
    if name == "PromptCacheEntry":
        record.input_ids.append(draw(token_ids))
        record.attention_mask.append(draw(st.integers(0, 1)))
    elif name == "GenerationBatch":
        k = draw(st.integers(0, 3))
        record.prompts.append(draw(texts))
        record.answers.append(draw(st.none() | texts))
        record.grouped_completions.append(draw(st.lists(texts, min_size=k, max_size=k)))
        if record.grouped_ref_meta is not None:
            record.grouped_ref_meta.append(draw(st.lists(json_values, min_size=k, max_size=k)))
        if record.grouped_completion_info is not None:
            infos = draw(st.lists(completion_info(), min_size=k, max_size=k))
            record.grouped_completion_info.append(infos)
            for group in record.grouped_completion_info:
                for info in group:
                    info["edited"] = True  # a dict read from the record, changed in place
    elif name == "PromptCompletionBatch":
        record.prompts.append(draw(texts))
        record.completions.append(draw(texts))
        if record.metadata is not None:
            record.metadata.append(draw(completion_info()))
    elif name in ("AdvantageStats", "QDistribution"):
        group = draw(st.lists(floats, max_size=3))
        record.grouped.append(group)
        record.samples.extend(group)
        if record.samples:
            record.samples[0] = record.grouped[next(g for g, v in enumerate(record.grouped) if v)][
                0
            ] = draw(floats)
    elif name == "RewardComputation":
        n = len(record.total_utils)
        record.per_reward_values["added"] = draw(st.lists(floats, min_size=n, max_size=n))
        if n:
            record.total_utils[draw(st.integers(0, n - 1))] = draw(floats)
            record.pairs.completions[-1] = draw(texts)
        record.entropy_bonus_scale = draw(opt_floats)
    elif name == "ScoreBatch":
        record.slice_size = draw(st.integers(0, 8))
        if record.prompt_entries:
            ids = draw(st.lists(token_ids, max_size=3))
            record.prompt_entries[-1] = PromptCacheEntry(ids, [1] * len(ids))
    elif name == "SequenceScores":
        record.cur_logp_sum = record.cur_logp_sum * 2
    elif name == "ReferenceLogprobs":
        record.ref_logp_mean = draw(floats)
    elif name == "LossOutputs":
        record.scalars = draw(loss_bundles)
    elif name == "BatchDiagnostics":
        record.kl_per_token_by_len_bucket["257+"] = draw(floats)
        record.kl_value = draw(opt_floats)
    else:  # RewardMoments, LossScalarBundle, LengthStats
        field = draw(st.sampled_from([f.name for f in dataclasses.fields(record)]))
        setattr(record, field, draw(floats))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("born", ["python", "arrow"])
def test_edits_then_to_arrow_parquet_from_arrow(name, born, parquet_roundtrip):
    @EXAMPLES
    @given(STRATEGIES[name], st.data())
    def run(record, data):
        if born == "arrow":
            record = type(record).from_arrow(parquet_roundtrip(record.to_arrow()))
        mutate(record, data)
        back = type(record).from_arrow(parquet_roundtrip(record.to_arrow()))
        assert records_equal(back, record), (back, record)

    run()
