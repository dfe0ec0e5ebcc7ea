"""Arrow layouts of the seed classes: ``encode(record)`` and ``decode(cls, batch)``.

Row units:

==========================  =========================================================
class                        one row per
==========================  =========================================================
GenerationBatch,             prompt group (``P`` rows; per-completion data in list columns)
RewardComputation,
AdvantageStats,
QDistribution
PromptCompletionBatch,       sample (``N`` rows)
ScoreBatch, SequenceScores,
ReferenceLogprobs,
LossOutputs
PromptCacheEntry, scalar     one row
classes
==========================  =========================================================

Column names follow the group table of :mod:`maxent_arrow.arrow.schema` where the same data appear
there (``advantages``, ``q``, ``total_utils``, ``rewards``, ``completions`` ...), so a rollout
batch can be assembled from these batches by column.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from maxent_arrow.arrow import ArrowSequence, GroupedSequence, InfoSequence, JsonSequence
from maxent_arrow.errors import SchemaError
from maxent_arrow.types import rewards as R
from maxent_arrow.types.base import PromptEntries
from maxent_arrow.types.columns import (
    RecordReader,
    column_matrix,
    column_tensor,
    dtype_name,
    grouped,
    is_float,
    is_int,
    is_list_of,
    is_struct,
    is_text,
    list_to_padded,
    make_batch,
    mask_from_lengths,
    matrix_column,
    padded_to_list,
    prefix_lengths,
    tensor_column,
)


def _is_float_list(kind: pa.DataType) -> bool:
    return is_list_of(is_float)(kind)


# ---------------------------------------------------------------------------- scalar classes
def _scalar_type(cls) -> dict[str, pa.DataType]:
    if cls is R.BatchDiagnostics:
        bucket = pa.map_(pa.string(), pa.float64())
        return {
            f.name: bucket if f.name.endswith("_by_len_bucket") else pa.float64()
            for f in dataclasses.fields(cls)
        }
    return {f.name: pa.float64() for f in dataclasses.fields(cls)}


def _encode_scalars(record) -> pa.RecordBatch:
    types = _scalar_type(type(record))
    columns = {}
    for name, kind in types.items():
        value = getattr(record, name)
        if pa.types.is_map(kind):
            value = list(value.items())
        columns[name] = pa.array([value], type=kind)
    return make_batch(type(record).__name__, columns, {}, 1)


def _decode_scalars(cls, reader: RecordReader):
    types = _scalar_type(cls)
    if reader.num_rows != 1:
        raise SchemaError(f"{reader.owner}: expected one row, got {reader.num_rows}")
    values = {}
    for name, kind in types.items():
        check = pa.types.is_map if pa.types.is_map(kind) else is_float
        value = reader.column(name, check, str(kind))[0].as_py()
        values[name] = dict(value) if pa.types.is_map(kind) else value
    return cls(**values)


# ---------------------------------------------------------------------------- groups
def _group_columns(gen: R.GenerationBatch) -> dict[str, pa.Array | None]:
    return {
        "prompt": gen.prompts.arrow,
        "answer": gen.answers.arrow,
        "completions": gen.grouped_completions.arrow,
        "ref_meta": None if gen.grouped_ref_meta is None else gen.grouped_ref_meta.arrow,
        "completion_info": (
            None if gen.grouped_completion_info is None else gen.grouped_completion_info.arrow
        ),
    }


def _encode_generation(gen: R.GenerationBatch) -> pa.RecordBatch:
    return make_batch("GenerationBatch", _group_columns(gen), {}, len(gen.prompts))


def _decode_generation(cls, reader: RecordReader) -> R.GenerationBatch:
    ref = reader.column("ref_meta", is_list_of(is_text), "list<string>", optional=True)
    info = reader.column("completion_info", is_list_of(is_struct), "list<struct>", optional=True)
    return cls(
        prompts=ArrowSequence(reader.column("prompt", is_text, "string")),
        answers=ArrowSequence(reader.column("answer", is_text, "string")),
        grouped_completions=GroupedSequence(
            reader.column("completions", is_list_of(is_text), "list<string>")
        ),
        grouped_ref_meta=None if ref is None else GroupedSequence(ref, JsonSequence),
        grouped_completion_info=None if info is None else GroupedSequence(info, InfoSequence),
    )


def _encode_pair(record: R.AdvantageStats | R.QDistribution, column: str) -> pa.RecordBatch:
    name = type(record).__name__
    return make_batch(name, {column: record.grouped.arrow}, {}, len(record.grouped))


def _decode_pair(cls, reader: RecordReader, column: str):
    array = reader.column(column, _is_float_list, "list<double>")
    view = GroupedSequence(array)
    return cls(grouped=view, samples=view.samples)


def _encode_pairs(pairs: R.PromptCompletionBatch) -> pa.RecordBatch:
    columns = {
        # The prompt repeats K times per group: a dictionary keeps one copy of each string.
        "prompt": pairs.prompts.arrow.dictionary_encode()
        if not pa.types.is_dictionary(pairs.prompts.arrow.type)
        else pairs.prompts.arrow,
        "completion": pairs.completions.arrow,
        "metadata": None if pairs.metadata is None else pairs.metadata.arrow,
    }
    return make_batch("PromptCompletionBatch", columns, {}, len(pairs.prompts))


def _decode_pairs(cls, reader: RecordReader) -> R.PromptCompletionBatch:
    meta = reader.column("metadata", is_struct, "struct", optional=True)
    return cls(
        prompts=ArrowSequence(reader.column("prompt", is_text, "string")),
        completions=ArrowSequence(reader.column("completion", is_text, "string")),
        metadata=None if meta is None else InfoSequence(meta),
    )


def _encode_rewards(rc: R.RewardComputation) -> pa.RecordBatch:
    offsets = rc.advantage.grouped.offsets

    def by_group(view) -> pa.Array | None:
        return None if view is None else grouped(view.arrow, offsets)

    keys = list(rc.per_reward_values)
    rewards = None
    if keys:
        rewards = pa.StructArray.from_arrays(
            [by_group(rc.per_reward_values[k]) for k in keys], names=keys
        )
    shared_meta = rc.completion_metadata is not None and rc.completion_metadata == rc.pairs.metadata
    prompts = rc.pairs.prompts.arrow
    if pa.types.is_dictionary(prompts.type):
        prompts = prompts.cast(prompts.type.value_type)
    columns = {
        "prompts": grouped(prompts, offsets),
        "completions": grouped(rc.pairs.completions.arrow, offsets),
        "pairs_metadata": by_group(rc.pairs.metadata),
        "total_utils": by_group(rc.total_utils),
        "rewards": rewards,
        "advantages": rc.advantage.grouped.arrow,
        "q": rc.q_distribution.grouped.arrow,
        "ref_meta": by_group(rc.ref_logprob_meta),
        "completion_metadata": None if shared_meta else by_group(rc.completion_metadata),
        "seed_semantic_entropy": (
            None if rc.seed_semantic_entropies is None else rc.seed_semantic_entropies.arrow
        ),
        "seed_advantage_scale": (
            None if rc.seed_advantage_scales is None else rc.seed_advantage_scales.arrow
        ),
    }
    scalars = {
        "moments": [rc.moments.mean, rc.moments.std],
        "reward_keys": keys,
        "completion_metadata_is_pairs_metadata": shared_meta,
        "entropy_bonus_scale": rc.entropy_bonus_scale,
        "seed_alpha_effective": rc.seed_alpha_effective,
        "seed_max_possible_entropy": rc.seed_max_possible_entropy,
    }
    return make_batch("RewardComputation", columns, scalars, len(offsets) - 1)


def _flat(reader: RecordReader, name: str, check, expected: str, *, optional: bool = False):
    array = reader.column(name, is_list_of(check), f"list<{expected}>", optional=optional)
    return None if array is None else array.flatten()


def _decode_rewards(cls, reader: RecordReader) -> R.RewardComputation:
    advantages = GroupedSequence(reader.column("advantages", _is_float_list, "list<double>"))
    q = GroupedSequence(reader.column("q", _is_float_list, "list<double>"))
    per_reward: dict[str, ArrowSequence] = {}
    rewards = reader.column("rewards", is_struct, "struct<list<double>>", optional=True)
    for key in reader.scalar("reward_keys", []):
        if rewards is None or rewards.type.get_field_index(key) < 0:
            raise SchemaError(f"{reader.owner}: missing reward {key!r} in column 'rewards'")
        per_reward[key] = ArrowSequence(rewards.field(key).flatten())
    pairs_meta = _flat(reader, "pairs_metadata", is_struct, "struct", optional=True)
    pairs = R.PromptCompletionBatch(
        prompts=ArrowSequence(_flat(reader, "prompts", is_text, "string")),
        completions=ArrowSequence(_flat(reader, "completions", is_text, "string")),
        metadata=None if pairs_meta is None else InfoSequence(pairs_meta),
    )
    ref_meta = _flat(reader, "ref_meta", is_text, "string", optional=True)
    if reader.scalar("completion_metadata_is_pairs_metadata"):
        completion_meta = pairs.metadata
    else:
        flat = _flat(reader, "completion_metadata", is_struct, "struct", optional=True)
        completion_meta = None if flat is None else InfoSequence(flat)
    entropies = reader.column("seed_semantic_entropy", is_float, "double", optional=True)
    scales = reader.column("seed_advantage_scale", is_float, "double", optional=True)
    mean, std = reader.scalar("moments", [None, None])
    return cls(
        total_utils=ArrowSequence(_flat(reader, "total_utils", is_float, "double")),
        per_reward_values=per_reward,
        advantage=R.AdvantageStats(grouped=advantages, samples=advantages.samples),
        pairs=pairs,
        q_distribution=R.QDistribution(grouped=q, samples=q.samples),
        moments=R.RewardMoments(mean=mean, std=std),
        ref_logprob_meta=None if ref_meta is None else JsonSequence(ref_meta),
        completion_metadata=completion_meta,
        entropy_bonus_scale=reader.scalar("entropy_bonus_scale"),
        seed_semantic_entropies=None if entropies is None else ArrowSequence(entropies),
        seed_advantage_scales=None if scales is None else ArrowSequence(scales),
        seed_alpha_effective=reader.scalar("seed_alpha_effective"),
        seed_max_possible_entropy=reader.scalar("seed_max_possible_entropy"),
    )


# ---------------------------------------------------------------------------- tensors
def _dtypes(record, names) -> dict[str, str | None]:
    return {
        n: None if getattr(record, n) is None else dtype_name(getattr(record, n).dtype)
        for n in names
    }


def _encode_score_batch(sb: R.ScoreBatch) -> pa.RecordBatch:
    lengths = prefix_lengths("ScoreBatch.completion_attention_mask", sb.completion_attention_mask)
    columns = {
        "prompt_ids": sb.prompt_entries.ids,
        "prompt_attention_mask": sb.prompt_entries.masks,
        "completion_ids": padded_to_list("ScoreBatch.completion_ids", sb.completion_ids, lengths),
    }
    scalars = {
        name: getattr(sb, name)
        for name in (
            "pad_token_id",
            "max_prompt_len",
            "slice_size",
            "total_sequences",
            "score_tail_tokens",
        )
    }
    scalars["width"] = int(sb.completion_ids.shape[1])
    scalars["dtypes"] = _dtypes(sb, ("completion_ids", "completion_attention_mask"))
    return make_batch("ScoreBatch", columns, scalars, sb.completion_ids.shape[0])


def _decode_score_batch(cls, reader: RecordReader) -> R.ScoreBatch:
    dtypes = reader.scalar("dtypes", {})
    width = reader.scalar("width")
    pad = reader.scalar("pad_token_id")
    ids, lengths = list_to_padded(
        reader, "completion_ids", width, dtypes.get("completion_ids", "int64"), pad
    )
    entries = PromptEntries(
        reader.column("prompt_ids", is_list_of(is_int), "list<int32>"),
        reader.column("prompt_attention_mask", is_list_of(is_int), "list<int8>"),
    )
    return cls(
        prompt_entries=entries,
        completion_ids=ids,
        completion_attention_mask=mask_from_lengths(
            lengths, width, dtypes.get("completion_attention_mask", "int64")
        ),
        pad_token_id=pad,
        max_prompt_len=reader.scalar("max_prompt_len"),
        slice_size=reader.scalar("slice_size"),
        total_sequences=reader.scalar("total_sequences"),
        score_tail_tokens=reader.scalar("score_tail_tokens"),
    )


def _per_token(field: str, values, mask, lengths) -> pa.Array | None:
    if values is None:
        return None
    return padded_to_list(field, values, lengths)


def _token_lengths(field: str, values, mask) -> torch.Tensor | None:
    if values is None:
        return None
    if mask is not None:
        return prefix_lengths(field, mask)
    return torch.full((values.shape[0],), values.shape[1], dtype=torch.int64)


_SCORE_VECTORS = (
    "cur_logp_sum",
    "behavior_logp_sum",
    "log_ratio_train",
    "denom_tok_tensor",
    "policy_entropy_sum",
)


def _encode_sequence_scores(ss: R.SequenceScores) -> pa.RecordBatch:
    lengths = _token_lengths("SequenceScores.token_mask", ss.token_logp, ss.token_mask)
    old_lengths = lengths
    if ss.old_token_logp is not None and lengths is None:
        old_lengths = _token_lengths("SequenceScores.token_mask", ss.old_token_logp, ss.token_mask)
    columns = {name: tensor_column(getattr(ss, name)) for name in _SCORE_VECTORS}
    columns["pooled_hidden"] = matrix_column(ss.pooled_hidden)
    columns["token_logp"] = _per_token("SequenceScores.token_logp", ss.token_logp, None, lengths)
    columns["old_token_logp"] = _per_token(
        "SequenceScores.old_token_logp", ss.old_token_logp, None, old_lengths
    )
    widths = {
        n: None if getattr(ss, n) is None else int(getattr(ss, n).shape[1])
        for n in ("token_logp", "old_token_logp")
    }
    if ss.token_mask is not None:
        # The mask alone (no per-token values) still needs its lengths stored.
        columns["token_count"] = pa.array(
            prefix_lengths("SequenceScores.token_mask", ss.token_mask).numpy().astype(np.int32)
        )
        widths["token_mask"] = int(ss.token_mask.shape[1])
    names = (*_SCORE_VECTORS, "pooled_hidden", "token_logp", "old_token_logp", "token_mask")
    scalars = {"dtypes": _dtypes(ss, names), "widths": widths}
    return make_batch("SequenceScores", columns, scalars, ss.cur_logp_sum.shape[0])


def _decode_sequence_scores(cls, reader: RecordReader) -> R.SequenceScores:
    dtypes = reader.scalar("dtypes", {})
    widths = reader.scalar("widths", {})
    values = {
        name: column_tensor(reader, name, dtypes.get(name), optional=name == "policy_entropy_sum")
        for name in _SCORE_VECTORS
    }
    values["pooled_hidden"] = column_matrix(
        reader, "pooled_hidden", dtypes.get("pooled_hidden"), optional=True
    )
    for name in ("token_logp", "old_token_logp"):
        values[name], _ = list_to_padded(
            reader, name, widths.get(name), dtypes.get(name), 0.0, optional=True
        )
    counts = column_tensor(reader, "token_count", None, optional=True)
    values["token_mask"] = (
        None
        if counts is None
        else mask_from_lengths(counts.to(torch.int64), widths["token_mask"], dtypes["token_mask"])
    )
    return cls(**values)


def _encode_reference(ref: R.ReferenceLogprobs) -> pa.RecordBatch:
    lengths = _token_lengths(
        "ReferenceLogprobs.ref_token_mask", ref.ref_token_logp, ref.ref_token_mask
    )
    columns = {
        name: tensor_column(getattr(ref, name))
        for name in ("ref_logp_sum", "ref_tok_counts", "ref_logp_sum_raw")
    }
    columns["ref_token_logp"] = _per_token(
        "ReferenceLogprobs.ref_token_logp", ref.ref_token_logp, None, lengths
    )
    if ref.ref_token_mask is not None and ref.ref_token_logp is None:
        raise SchemaError(
            "ReferenceLogprobs.ref_token_mask: a mask without ref_token_logp cannot be stored"
        )
    names = (
        "ref_logp_sum",
        "ref_tok_counts",
        "ref_logp_sum_raw",
        "ref_token_logp",
        "ref_token_mask",
    )
    scalars = {
        "ref_logp_mean": ref.ref_logp_mean,
        "avg_completion_tokens": ref.avg_completion_tokens,
        "dtypes": _dtypes(ref, names),
        "width": None if ref.ref_token_logp is None else int(ref.ref_token_logp.shape[1]),
        "has_mask": ref.ref_token_mask is not None,
    }
    return make_batch("ReferenceLogprobs", columns, scalars, ref.ref_logp_sum.shape[0])


def _decode_reference(cls, reader: RecordReader) -> R.ReferenceLogprobs:
    dtypes = reader.scalar("dtypes", {})
    width = reader.scalar("width")
    token_logp, lengths = list_to_padded(
        reader, "ref_token_logp", width, dtypes.get("ref_token_logp"), 0.0, optional=True
    )
    mask = None
    if token_logp is not None and reader.scalar("has_mask"):
        mask = mask_from_lengths(lengths, width, dtypes["ref_token_mask"])
    return cls(
        ref_logp_sum=column_tensor(reader, "ref_logp_sum", dtypes.get("ref_logp_sum")),
        ref_tok_counts=column_tensor(reader, "ref_tok_counts", dtypes.get("ref_tok_counts")),
        ref_logp_sum_raw=column_tensor(reader, "ref_logp_sum_raw", dtypes.get("ref_logp_sum_raw")),
        ref_logp_mean=reader.scalar("ref_logp_mean"),
        avg_completion_tokens=reader.scalar("avg_completion_tokens"),
        ref_token_logp=token_logp,
        ref_token_mask=mask,
    )


def _encode_loss(out: R.LossOutputs) -> pa.RecordBatch:
    columns = {
        "log_ratio_train": tensor_column(out.log_ratio_train),
        "denom_tok_tensor": tensor_column(out.denom_tok_tensor),
    }
    scalars = {
        "loss": float(out.loss.detach().cpu().item()),
        "dtypes": _dtypes(out, ("loss", "log_ratio_train", "denom_tok_tensor")),
        "scalars": dataclasses.asdict(out.scalars),
    }
    return make_batch("LossOutputs", columns, scalars, out.log_ratio_train.shape[0])


def _decode_loss(cls, reader: RecordReader) -> R.LossOutputs:
    dtypes = reader.scalar("dtypes", {})
    loss = torch.tensor(reader.scalar("loss"), dtype=torch.float64)
    return cls(
        loss=loss.to(getattr(torch, dtypes.get("loss", "float32"))),
        scalars=R.LossScalarBundle(**reader.scalar("scalars")),
        log_ratio_train=column_tensor(reader, "log_ratio_train", dtypes.get("log_ratio_train")),
        denom_tok_tensor=column_tensor(reader, "denom_tok_tensor", dtypes.get("denom_tok_tensor")),
    )


def _encode_prompt_entry(entry: R.PromptCacheEntry) -> pa.RecordBatch:
    columns = {
        "input_ids": grouped(entry.input_ids.arrow, np.array([0, len(entry.input_ids)])),
        "attention_mask": grouped(entry.attention_mask.arrow, np.array([0, len(entry.input_ids)])),
    }
    return make_batch("PromptCacheEntry", columns, {}, 1)


def _decode_prompt_entry(cls, reader: RecordReader) -> R.PromptCacheEntry:
    if reader.num_rows != 1:
        raise SchemaError(f"{reader.owner}: expected one row, got {reader.num_rows}")
    ids = reader.column("input_ids", is_list_of(is_int), "list<int32>")
    mask = reader.column("attention_mask", is_list_of(is_int), "list<int8>")
    return cls(input_ids=ArrowSequence(ids.flatten()), attention_mask=ArrowSequence(mask.flatten()))


_SCALAR_CLASSES = (R.RewardMoments, R.LossScalarBundle, R.LengthStats, R.BatchDiagnostics)

_ENCODERS: dict[type, Any] = {
    R.PromptCacheEntry: _encode_prompt_entry,
    R.GenerationBatch: _encode_generation,
    R.PromptCompletionBatch: _encode_pairs,
    R.AdvantageStats: lambda r: _encode_pair(r, "advantages"),
    R.QDistribution: lambda r: _encode_pair(r, "q"),
    R.RewardComputation: _encode_rewards,
    R.ScoreBatch: _encode_score_batch,
    R.SequenceScores: _encode_sequence_scores,
    R.ReferenceLogprobs: _encode_reference,
    R.LossOutputs: _encode_loss,
    **{cls: _encode_scalars for cls in _SCALAR_CLASSES},
}

_DECODERS: dict[type, Any] = {
    R.PromptCacheEntry: _decode_prompt_entry,
    R.GenerationBatch: _decode_generation,
    R.PromptCompletionBatch: _decode_pairs,
    R.AdvantageStats: lambda cls, rd: _decode_pair(cls, rd, "advantages"),
    R.QDistribution: lambda cls, rd: _decode_pair(cls, rd, "q"),
    R.RewardComputation: _decode_rewards,
    R.ScoreBatch: _decode_score_batch,
    R.SequenceScores: _decode_sequence_scores,
    R.ReferenceLogprobs: _decode_reference,
    R.LossOutputs: _decode_loss,
    **{cls: _decode_scalars for cls in _SCALAR_CLASSES},
}


def encode(record) -> pa.RecordBatch:
    validate = getattr(record, "validate", None)
    if validate is not None:
        validate()
    for cls in type(record).__mro__:
        if cls in _ENCODERS:
            return _ENCODERS[cls](record)
    raise SchemaError(f"{type(record).__name__} has no Arrow form")


def decode(cls, data: pa.RecordBatch | pa.Table):
    for base in cls.__mro__:
        if base in _DECODERS:
            return _DECODERS[base](cls, RecordReader(cls.__name__, data))
    raise SchemaError(f"{cls.__name__} has no Arrow form")
