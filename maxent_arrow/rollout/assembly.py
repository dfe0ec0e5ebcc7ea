"""``RolloutBatch.from_parts``: one step's seed objects to a group batch and a step row.

:class:`GroupColumns` collects the group table's columns part by part (generation, token ids,
rewards, reference, behaviour scores, weights); :func:`step_values` collects the step row.
Per-sample ``[N]`` columns of the seed classes (their ``to_arrow()`` layouts, named like the
group table on purpose) are regrouped by the generation's group offsets: a new offsets buffer
over the same child values, no copy of the token or log-prob bytes (a cast copies only when a
dtype must change, e.g. int64 token ids to int32).

Nothing here imports torch: the seed classes and ``Ragged`` are reached through their lazy
packages, which are loaded by the time seed objects exist.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from maxent_arrow import arrow as A
from maxent_arrow import types as T
from maxent_arrow.arrow import GroupIdentity, kept_ids_array, list_offsets, regroup
from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow import schema as S
from maxent_arrow.arrow.registry import CORE, MAXENT
from maxent_arrow.arrow.upgrade import reward_lists
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.rollout.checks import BATCH_META_KEY, StepHeader, config_json

__all__ = ["GroupColumns", "check_parts", "step_values"]

_IDS_TYPE = dict((f.name, f.type) for f in S.GROUP_FIELDS)["completion_ids"]


def _float_values(name: str, value: Any) -> pa.Array:
    """Flat per-sample values (a tensor, a list, an Arrow array) as a float64 array."""
    if isinstance(value, pa.Array | pa.ChunkedArray):
        return value
    tensor = getattr(value, "detach", None)
    if tensor is not None:
        return pa.array(value.detach().cpu().double().reshape(-1).numpy())
    try:
        return pa.array(value, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise SchemaError(f"RolloutBatch.from_parts: {name}: expected numbers ({exc})") from None


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def check_parts(parts: Mapping[str, Any]) -> None:
    """Each given part has the seed type ``from_parts`` documents for it."""
    expected = {
        "generation": (T.GenerationBatch, "GenerationBatch"),
        "rewards": (T.RewardComputation, "RewardComputation"),
        "score_batch": (T.ScoreBatch, "ScoreBatch"),
        "reference": (T.ReferenceLogprobs, "ReferenceLogprobs"),
        "scores": (T.SequenceScores, "SequenceScores"),
        "length_stats": (T.LengthStats, "LengthStats"),
        "loss": (T.LossOutputs | T.LossScalarBundle, "LossOutputs or LossScalarBundle"),
        "diagnostics": (T.BatchDiagnostics, "BatchDiagnostics"),
    }
    if parts.get("generation") is None:
        raise SchemaError(
            "RolloutBatch.from_parts: generation expected a GenerationBatch, got None"
        )
    for name, (kind, label) in expected.items():
        _typed(name, parts.get(name), kind, label)


_REWARD_LISTS = ("reward_names", "reward_values")


# The stored length statistics (LengthStats's fields): min, mean, max, clipped ratio, then the
# terminated completions' min, mean, max.
LENGTH_FIELDS = R.feeding("LengthStats", R.STEP)


class GroupColumns:
    """The group table's columns of one step, filled part by part.

    Built from the generation (prompts, answers, completions, ref meta, completion info, and
    the generator's token ids if the completion info carries them); each ``add_*`` method then
    adds what one seed object holds, checked against the generation's group sizes.
    """

    def __init__(self, generation: Any, *, step: int, rank: int, kind: str):
        gen = generation.to_arrow()
        self.num_groups = gen.num_rows
        completions = gen.column("completions")
        self.offsets = list_offsets(completions)
        self.num_samples = int(self.offsets[-1]) if len(self.offsets) else 0
        # The seed records are this library's MaxEnt-GRPO layout (docs/arrow-layout.md).
        self.meta: dict[str, Any] = {"dtypes": {}, "widths": {}, "families": [CORE, MAXENT]}
        # Step-row scalars of the parts, as their checked Arrow forms hold them.
        self.scalars: dict[str, Any] = {}
        identity = GroupIdentity.of(step=step, rank=rank, kind=kind, group_offsets=self.offsets)
        self.columns: dict[str, pa.Array | None] = dict(identity.columns())
        # The generation's columns are the group table's (GenerationBatch's to_arrow layout).
        for name in R.feeding("GenerationBatch"):
            self.columns[name] = _column(gen, name)
        info, self._info_ids = _split_info(_column(gen, "completion_info"), self.offsets)
        self.columns["completion_info"] = info

    def set_group_identity(self, group_ids: Any, group_sizes: Any, completion_indices: Any) -> None:
        """Groups that are parts of larger ones (a trainer that spreads one prompt's
        completions over ranks): each row's run-wide ``group_id``, the whole group's size and
        each completion's index in the whole group (flat ``[N]``, in group order)."""
        p, n = self.num_groups, self.num_samples
        ids = pa.array(list(group_ids), pa.string())
        sizes = pa.array(np.asarray(group_sizes, dtype=np.int64), pa.int64())
        index = pa.array(np.asarray(completion_indices, dtype=np.int64), pa.int64())
        _check_rows("group_ids", ids, p, unit="groups")
        _check_rows("group_sizes", sizes, p, unit="groups")
        _check_rows("completion_indices", index, n)
        if ids.null_count:
            raise LayoutError("RolloutBatch.from_parts: group_ids has a null")
        own = np.diff(self.offsets)
        got = sizes.to_numpy()
        if (got < own).any() or (index.to_numpy() < 0).any():
            g = int(np.flatnonzero(got < own)[0]) if (got < own).any() else -1
            raise LayoutError(
                "RolloutBatch.from_parts: group_sizes must be at least each row's completions"
                + (f" (group {g}: {got[g]} < {own[g]})" if g >= 0 else "")
                + " and completion_indices >= 0"
            )
        self.columns["group_id"] = ids
        self.columns["group_size"] = sizes.cast(pa.int32())
        self.columns["completion_index"] = regroup(index.cast(pa.int32()), self.offsets)

    def add_token_ids(self, score_batch: Any) -> None:
        """Token ids: the exact scored ids of ``score_batch`` first, the generator's ids (from
        the completion info) otherwise; generator ids that differ from the scored ones are
        kept in the completion info's JSON ``extra``."""
        completion_ids = None
        offsets, n = self.offsets, self.num_samples
        if score_batch is not None:
            sb = score_batch.to_arrow()
            _check_rows("score_batch", sb.column("completion_ids"), n)
            sizes = np.diff(offsets)
            if self.num_groups and int(sizes.min()) == 0:
                g = int(np.flatnonzero(sizes == 0)[0])
                raise LayoutError(
                    f"RolloutBatch.from_parts: group {g} has no completions, so its prompt ids "
                    "cannot be taken from score_batch"
                )
            self.columns["prompt_ids"] = sb.column("prompt_ids").take(pa.array(offsets[:-1]))
            completion_ids = _per_token(
                "score_batch.completion_ids", sb.column("completion_ids"), offsets, pa.int32()
            )
        info_ids = self._info_ids
        if info_ids is not None:
            info_ids = info_ids.cast(_IDS_TYPE)
            if completion_ids is None:
                completion_ids = info_ids
                self.meta["info_token_ids"] = True
            elif info_ids.flatten().equals(completion_ids.flatten()):
                self.meta["info_token_ids"] = True
            else:
                self.columns["completion_info"] = _ids_into_extra(
                    self.columns["completion_info"], info_ids
                )
        self.columns["completion_ids"] = completion_ids

    def add_rewards(self, rewards: Any) -> None:
        """Utilities, per-function raw rewards, advantages, q and the SEED-GRPO group
        columns."""
        offsets = self.offsets
        rc = rewards.to_arrow()  # checked; the record's own batch when it came from Arrow
        _check_offsets("rewards.advantage.grouped", list_offsets(rc.column("advantages")), offsets)
        _check_offsets("rewards.q_distribution.grouped", list_offsets(rc.column("q")), offsets)
        # The columns RewardComputation's to_arrow layout shares with the group table (but
        # those the generation gave: its ref meta); the raw rewards (a struct there, names
        # and values here) follow.
        for name in R.feeding("RewardComputation"):
            if name not in _REWARD_LISTS and name not in R.feeding("GenerationBatch"):
                self.columns[name] = _column(rc, name)
        per_reward = _column(rc, "rewards")
        names = [] if per_reward is None else [f.name for f in per_reward.type]
        if names:
            assert per_reward is not None  # it named them
            values = [
                np.asarray(
                    per_reward.field(j).flatten().to_numpy(zero_copy_only=False), dtype=np.float64
                )
                for j in range(len(names))
            ]
            self.columns["reward_names"], self.columns["reward_values"] = reward_lists(
                names, values, offsets
            )
        self.scalars.update(
            {
                k: v
                for k, v in T.record_scalars(rc).items()
                if k in ("entropy_bonus_scale", "seed_alpha_effective", "seed_max_possible_entropy")
            }
        )
        self.scalars["reward_mean"], self.scalars["reward_std"] = T.record_scalars(rc)["moments"]

    def add_weights(self, weights: Any) -> None:
        self.columns["weights"] = _grouped_floats("weights", weights, self.offsets)

    def add_reference(self, reference: Any) -> None:
        """Raw reference sums R_i, token counts T_i and per-token reference log-probs, with
        the tensor dtypes, kinds and widths needed to give the seed object back as it was."""
        offsets, n, meta = self.offsets, self.num_samples, self.meta
        rf = reference.to_arrow()  # checked; the record's own batch when it came from Arrow
        given = T.record_scalars(rf)
        for name, dtype in given.get("dtypes", {}).items():
            if dtype is not None:
                meta["dtypes"][name] = dtype
        if given.get("kinds"):
            meta["kinds"] = dict(given["kinds"])
        meta["has_ref_mask"] = bool(given.get("has_mask"))
        if given.get("width") is not None:
            meta["widths"]["ref_token_logp"] = int(given["width"])
        raw = rf.column("ref_logp_sum_raw")
        _check_rows("reference.ref_logp_sum_raw", raw, n)
        self.columns["ref_logp_sum_raw"] = regroup(raw.cast(pa.float64()), offsets)
        self.columns["ref_tok_counts"] = regroup(
            _counts_int32("reference.ref_tok_counts", rf.column("ref_tok_counts")), offsets
        )
        self.columns["ref_token_logp"] = _per_token(
            "reference.ref_token_logp", _column(rf, "ref_token_logp"), offsets, pa.float32()
        )
        self.scalars["ref_logp_mean"] = given.get("ref_logp_mean")
        self.scalars["avg_completion_tokens"] = given.get("avg_completion_tokens")

    def add_scores(self, scores: Any) -> None:
        """Behaviour sums, entropy sums and per-token behaviour log-probs of the scorer."""
        offsets, n = self.offsets, self.num_samples
        ss = scores.to_arrow()
        for name in ("behavior_logp_sum", "policy_entropy_sum"):
            value = _column(ss, name)
            if value is not None:
                _check_rows(f"scores.{name}", value, n)
                # Sums stay in double (docs/seed-bugs.md: no bf16 accumulation).
                self.columns[name] = regroup(value.cast(pa.float64()), offsets)
        self.columns["behavior_token_logp"] = _per_token(
            "scores.old_token_logp", _column(ss, "old_token_logp"), offsets, pa.float32()
        )

    def add_behavior_tokens(self, behavior_token_logp: Any) -> None:
        """The sampler's own per-token rows (one value per generated token); they take
        precedence over the scorer's view, which covers only the scored tokens."""
        rows = (
            behavior_token_logp.to_arrow()
            if isinstance(behavior_token_logp, A.Ragged)
            else behavior_token_logp
        )
        self.columns["behavior_token_logp"] = _per_token(
            "behavior_token_logp", rows, self.offsets, pa.float32()
        )

    def add_offpolicy(
        self,
        *,
        policy_versions: Any = None,
        version_runs: Any = None,
        logp_semantics: Any = None,
        sampling: Mapping[str, Any] | None = None,
        kept_token_ids: Any = None,
        topk: Any = None,
    ) -> None:
        """The off-policy contract (``docs/arrow-layout.md``, "Off-policy data"); see
        :meth:`RolloutBatch.from_parts <maxent_arrow.rollout.RolloutBatch.from_parts>`. The
        values are checked here for their shapes and by the batch's checks for their ranges
        (:func:`~maxent_arrow.rollout.checks.check_offpolicy`)."""
        offsets, n = self.offsets, self.num_samples
        if policy_versions is not None:
            versions = _per_sample(
                "policy_versions", policy_versions, n, _leaf("completion_policy_version")
            )
            self.columns["completion_policy_version"] = regroup(versions, offsets)
        if version_runs is not None:
            if not isinstance(version_runs, tuple) or len(version_runs) != 2:
                raise SchemaError(
                    "RolloutBatch.from_parts: version_runs expected (starts, versions): per "
                    "completion, the token index and policy version of each run"
                )
            for name, value in zip(("version_run_starts", "version_run_versions"), version_runs):
                rows = _nested(f"version_runs ({name})", value, pa.list_(_leaf(name)))
                _check_rows(f"version_runs ({name})", rows, n)
                self.columns[name] = regroup(rows, offsets)
        if logp_semantics is not None:
            self.columns["behavior_logp_semantics"] = regroup(
                _per_sample("logp_semantics", logp_semantics, n, _leaf("behavior_logp_semantics")),
                offsets,
            )
        for param, value in (sampling or {}).items():
            name = R.SAMPLING_COLUMNS.get(param)
            if name is None:
                raise SchemaError(
                    f"RolloutBatch.from_parts: sampling: unknown parameter {param!r}; expected "
                    f"some of {list(R.SAMPLING_COLUMNS)}"
                )
            if value is None:
                continue
            self.columns[name] = regroup(
                _per_sample(f"sampling[{param!r}]", value, n, _leaf(name)), offsets
            )
        if kept_token_ids is not None:
            values, set_offsets, token_offsets = self._token_sets("kept_token_ids", kept_token_ids)
            self.columns["kept_token_ids"] = kept_ids_array(
                values, set_offsets, token_offsets, offsets,
                where="RolloutBatch.from_parts: kept_token_ids",
            )
        if topk is not None:
            if not isinstance(topk, tuple) or len(topk) != 2:
                raise SchemaError(
                    "RolloutBatch.from_parts: topk expected (ids, logps): per token, the top-k "
                    "ids and their log-probs"
                )
            for name, value in zip(("topk_token_ids", "topk_token_logp"), topk):
                values, set_offsets, token_offsets = self._token_sets(name, value)
                sets = pa.ListArray.from_arrays(
                    pa.array(set_offsets.astype(np.int32)), pa.array(values).cast(_leaf(name))
                )
                self.columns[name] = regroup(regroup(sets, token_offsets), offsets)

    def _token_sets(self, name: str, value: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(values, set_offsets, token_offsets)`` of per-token sets given as a ``Ragged``
        (one row per completion token, completions in group order) or per completion (a
        ``list<list<number>>`` array or nested Python lists, one row per completion)."""
        n = self.num_samples
        ids = self.columns.get("completion_ids")
        counts = None if ids is None else np.diff(list_offsets(ids.flatten()))
        if isinstance(value, A.Ragged):
            set_offsets = np.asarray(value.offsets.cpu().numpy(), dtype=np.int64)
            values = np.asarray(value.values.detach().cpu().numpy())
            if counts is None:
                raise SchemaError(
                    f"RolloutBatch.from_parts: {name}: a Ragged of token rows needs the "
                    "completion token ids (score_batch or the completion info) to split them"
                )
            if len(set_offsets) - 1 != int(counts.sum()):
                raise LayoutError(
                    f"RolloutBatch.from_parts: {name}: expected {int(counts.sum())} rows (one "
                    f"per completion token), got {len(set_offsets) - 1}"
                )
            return values, set_offsets, offsets_of_counts(counts)
        rows = _nested(name, value, pa.list_(pa.list_(pa.float64() if "logp" in name else pa.int64())))
        _check_rows(name, rows, n)
        token_offsets = list_offsets(rows)
        if counts is not None:
            got = np.diff(token_offsets)
            bad = np.flatnonzero(got != counts)
            if bad.size:
                i = int(bad[0])
                g = int(np.searchsorted(self.offsets, i, side="right") - 1)
                raise LayoutError(
                    f"RolloutBatch.from_parts: {name}: expected {counts[i]} token sets (one per "
                    f"completion token) at group {g}, sample {i - int(self.offsets[g])}, got "
                    f"{got[i]}"
                )
        sets = rows.flatten()
        set_offsets = list_offsets(sets)
        values = np.asarray(sets.flatten().to_numpy(zero_copy_only=False))
        return values, set_offsets, token_offsets

    def to_batch(self) -> pa.RecordBatch:
        """The group record batch in the schema's column order (absent parts left out)."""
        schema = S.group_schema()
        fields, arrays = [], []
        for field in schema:
            array = self.columns.get(field.name)
            if array is None:
                continue
            if isinstance(array, pa.ChunkedArray):
                array = array.combine_chunks()
            fields.append(pa.field(field.name, field.type, nullable=field.nullable))
            arrays.append(array if array.type == field.type else array.cast(field.type))
        metadata = {
            S.METADATA_KEY: S.SCHEMA_VERSION.encode(),
            BATCH_META_KEY: json.dumps(self.meta, sort_keys=True).encode(),
        }
        return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=metadata))


def step_values(
    columns: GroupColumns,
    *,
    step: int,
    rank: int,
    kind: str,
    config: Mapping[str, Any] | None,
    policy_version: int | None,
    parts: Mapping[str, Any],
) -> pa.RecordBatch:
    """The one-row step batch: identity, counts, the config snapshot and the scalars of the
    reward moments, reference summaries, length stats, loss and diagnostics."""
    values = StepHeader(
        step=step,
        rank=rank,
        kind=kind,
        num_groups=columns.num_groups,
        num_samples=columns.num_samples,
        config=config_json(config),
        policy_version=policy_version,
    ).values()
    # The parts' scalars as their checked Arrow forms hold them (the add_* methods read them).
    values.update(columns.scalars)
    for name in ("length_stats", "loss", "diagnostics"):
        part = parts.get(name)
        if part is None:
            continue
        if isinstance(part, T.LossOutputs):
            values.update(T.record_scalars(part.to_arrow())["scalars"])
            continue
        row = part.to_arrow().to_pylist()[0]
        if name == "diagnostics":
            labels = [label for label, _ in row[S.BUCKET_COLUMNS[0]]]
            for bucket in S.BUCKET_COLUMNS:
                if [label for label, _ in row[bucket]] != labels:
                    raise LayoutError(
                        f"RolloutBatch.from_parts: diagnostics.{bucket}: expected the buckets "
                        f"{labels} (as {S.BUCKET_COLUMNS[0]}), got "
                        f"{[label for label, _ in row[bucket]]}"
                    )
                row[bucket] = [value for _, value in row[bucket]]
            row["kl_length_buckets"] = labels
        if name == "length_stats" and row.get("clipped_ratio") == 1.0:
            # Every completion was clipped: the seed record says 0.0 for the terminated
            # statistics (the original's convention); the stored value of an empty set is
            # NULL (docs/formulas.md, "Step statistics").
            for field in LENGTH_FIELDS[4:]:
                row[field] = None
        values.update(row)
    utils = columns.columns.get("total_utils")
    if utils is not None:
        flat = np.asarray(utils.flatten().to_numpy(zero_copy_only=False), dtype=np.float64)
        values["num_scored"] = int(np.count_nonzero(~np.isnan(flat)))
    schema = S.step_schema()
    return pa.RecordBatch.from_pydict({f.name: [values.get(f.name)] for f in schema}, schema=schema)


def offsets_of_counts(counts: np.ndarray) -> np.ndarray:
    """int64 offsets from 0 of rows of ``counts`` items."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


def _leaf(name: str) -> pa.DataType:
    """The value type of stored group column ``name`` (the registry's, its one home)."""
    return R.column(name).leaf


def _per_sample(name: str, value: Any, n: int, kind: pa.DataType) -> pa.Array:
    """One value for every completion, or ``[N]`` values (a sequence, an array, a tensor)."""
    data: Any = value
    if isinstance(data, str | int | float | np.integer | np.floating):
        data = [data] * n
    elif hasattr(data, "detach"):
        data = data.detach().cpu().numpy()
    try:
        array = data.cast(kind) if isinstance(data, pa.Array) else pa.array(data, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise SchemaError(f"RolloutBatch.from_parts: {name}: expected {kind} values ({exc})") from None
    _check_rows(name, array, n)
    if array.null_count:
        i = int(np.flatnonzero(~np.asarray(array.is_valid().to_numpy(zero_copy_only=False)))[0])
        raise LayoutError(f"RolloutBatch.from_parts: {name}: null at sample {i}")
    return array


def _nested(name: str, value: Any, kind: pa.DataType) -> pa.Array:
    """Rows of lists (an Arrow list array, or nested Python lists) as one array."""
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        return value
    try:
        return pa.array(value, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise SchemaError(f"RolloutBatch.from_parts: {name}: expected {kind} rows ({exc})") from None


def _typed(name: str, value: Any, kind: Any, expected: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise SchemaError(
            f"RolloutBatch.from_parts: {name} expected a {expected}, got {type(value).__name__}"
        )
    return value


def _column(rb: pa.RecordBatch, name: str) -> pa.Array | None:
    if name not in rb.schema.names:
        return None
    return rb.column(name)


def _check_rows(owner: str, array: pa.Array, n: int, *, unit: str = "completions") -> None:
    if len(array) != n:
        what = "one per completion" if unit == "completions" else "one per group"
        raise LayoutError(
            f"RolloutBatch.from_parts: {owner} expected {n} rows ({what}, as generation), "
            f"got {len(array)}"
        )


def _check_offsets(owner: str, got: np.ndarray, expected: np.ndarray) -> None:
    if len(got) != len(expected):
        raise LayoutError(
            f"RolloutBatch.from_parts: {owner} expected {len(expected) - 1} groups (as "
            f"generation), got {len(got) - 1}"
        )
    if not np.array_equal(got, expected):
        g = int(np.flatnonzero(np.diff(got) != np.diff(expected))[0])
        raise LayoutError(
            f"RolloutBatch.from_parts: {owner} expected {int(expected[g + 1] - expected[g])} "
            f"completions at group {g} (as generation), got {int(got[g + 1] - got[g])}"
        )


def _split_info(info: pa.Array | None, offsets: np.ndarray):
    """Completion info without ``token_ids`` (they go to ``completion_ids``) and those ids."""
    if info is None:
        return None, None
    flat = info.flatten()
    names = [f.name for f in flat.type]
    token_ids = None
    if "token_ids" in names:
        candidate = flat.field(names.index("token_ids"))
        if candidate.null_count == 0:
            token_ids = regroup(candidate, offsets)
        elif candidate.null_count != len(candidate):
            i = int(np.flatnonzero(~candidate.is_valid().to_numpy(zero_copy_only=False))[0])
            g = int(np.searchsorted(offsets, i, side="right") - 1)
            raise LayoutError(
                "RolloutBatch.from_parts: generation.grouped_completion_info has token_ids for "
                f"some completions only (missing at group {g}, sample {i - offsets[g]})"
            )
    arrays = []
    for field in S.COMPLETION_INFO_TYPE:
        if field.name in names:
            arrays.append(flat.field(names.index(field.name)).cast(field.type))
        else:
            arrays.append(pa.nulls(len(flat), field.type))
    struct = pa.StructArray.from_arrays(
        arrays,
        fields=list(S.COMPLETION_INFO_TYPE),
        mask=flat.is_null() if flat.null_count else None,
    )
    return regroup(struct, offsets), token_ids


def _ids_into_extra(info: pa.Array, token_ids: pa.Array) -> pa.Array:
    """Keep completion-info token ids that differ from the scored ids in the JSON ``extra``.

    A rare path (re-tokenised completions, ``docs/seed-bugs.md`` §3): a loop over samples is
    fine.
    """
    flat = info.flatten()
    extras = flat.field("extra").to_pylist()
    ids = token_ids.flatten().to_pylist()
    merged = []
    for extra, item in zip(extras, ids):
        data = json.loads(extra) if extra else {}
        data["token_ids"] = item
        merged.append(json.dumps(data))
    arrays = [flat.field(i) for i in range(flat.type.num_fields)]
    arrays[flat.type.get_field_index("extra")] = pa.array(merged, pa.string())
    struct = pa.StructArray.from_arrays(arrays, fields=list(flat.type))
    return regroup(struct, list_offsets(info))


def _grouped_floats(name: str, value: Any, offsets: np.ndarray) -> pa.Array:
    """Per-sample values (flat ``[N]`` or already grouped) as ``list<double>`` by group."""
    if isinstance(value, T.AdvantageStats | T.QDistribution):
        value = value.column("grouped")
    if isinstance(value, A.Ragged):
        value = value.to_arrow()
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, list | tuple) and value and isinstance(value[0], list | tuple):
        value = pa.array(value, pa.list_(pa.float64()))
    # pyarrow is untyped to a checker, so `isinstance` does not narrow `value` to an array.
    if isinstance(value, pa.Array) and (
        pa.types.is_list(value.type)  # pyright: ignore[reportAttributeAccessIssue]
        or pa.types.is_large_list(value.type)  # pyright: ignore[reportAttributeAccessIssue]
    ):
        _check_offsets(name, list_offsets(value), offsets)
        flat = value.flatten()  # pyright: ignore[reportAttributeAccessIssue]
    else:
        flat = _float_values(name, value)
        _check_rows(name, flat, int(offsets[-1]))
    if flat.null_count:
        raise LayoutError(f"RolloutBatch.from_parts: {name} has a null value")
    return regroup(flat.cast(pa.float64()), offsets)


def _counts_int32(name: str, array: pa.Array) -> pa.Array:
    try:
        return array.cast(pa.int32())  # safe cast: refuses fractional or out-of-range counts
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise LayoutError(
            f"RolloutBatch.from_parts: {name} expected whole numbers ({exc})"
        ) from None


def _per_token(name: str, array: pa.Array | None, offsets: np.ndarray, kind: pa.DataType):
    if array is None:
        return None
    _check_rows(name, array, int(offsets[-1]))
    inner = pa.list_(pa.field("item", kind, nullable=False))
    try:
        return regroup(array.cast(inner), offsets)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise _token_error(name, array, offsets, kind, exc) from None


def _token_error(
    name: str, array: pa.Array, offsets: np.ndarray, kind: pa.DataType, exc: Exception
) -> LayoutError:
    """Where a per-token value does not fit ``kind``: group, sample and token named."""
    values = array.flatten()
    rows = list_offsets(array)
    bad = None
    if pa.types.is_integer(kind) and pa.types.is_integer(values.type):
        info = np.iinfo(kind.to_pandas_dtype())
        data = np.asarray(values.to_numpy(zero_copy_only=False))
        hits = np.flatnonzero((data < info.min) | (data > info.max))
        bad = int(hits[0]) if len(hits) else None
    if bad is None:
        return LayoutError(f"RolloutBatch.from_parts: {name}: expected {kind} values ({exc})")
    sample = int(np.searchsorted(rows, bad, side="right") - 1)
    group = int(np.searchsorted(offsets, sample, side="right") - 1)
    return LayoutError(
        f"RolloutBatch.from_parts: {name}: value {values[bad].as_py()} at group {group}, "
        f"sample {sample - offsets[group]}, token {bad - rows[sample]} does not fit {kind}"
    )
