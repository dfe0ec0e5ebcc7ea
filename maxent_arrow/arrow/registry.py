"""The column registry: every column the store keeps, declared once.

Each :class:`Column` says what a column is (name, Arrow type, level), which run layouts carry
it (its families), how it is written (Parquet settings), how it is read (its alias in the
``samples`` view) and what it is for (the seed class and field it feeds, its meaning). The
group and step schemas (:mod:`.schema`), the Parquet settings (``store/storage/parquet.py``), the SQL
views' aliases (``store/sql/plan.py``), the read-back field lists, the TRL and verl column maps
and the column table of ``docs/arrow-layout.md`` are derived from it. A new column is one row
here (plus its math).

**Families.** A run's layout is ``core`` plus the families of the trainer that wrote it:
``maxent`` (this library's MaxEnt-GRPO trainer and the seed records), ``trl`` (TRL's
``GRPOTrainer`` recorder), ``verl`` (verl's ``DataProto``). A column belongs to one or more
families; a run carries exactly the columns of its families (absent ones as nulls), so every
file of a run has one schema for plain readers, and a TRL run has no MaxEnt column at all.
The families are fixed at a run's first append and recorded in every step file.

**Levels.** ``group``: one value per group row; ``completion``: ``list<T>``, one item per
completion of the row; ``token``: ``list<list<T>>``, one list per completion, one item per
token; ``step``: one value per step row; ``record``: one value per row of a record table.

**Tables.** ``groups`` and ``steps`` (the rollouts), and ``trainer_metrics``, a record table:
the figures a trainer logs about its optimizer steps (loss, KL, entropy, clip ratios, grad
norm, learning rate), one row per log, written after the rollout step they trained on.

**User columns.** A run may also keep columns whose names only its user knows: the dataset
columns a recorder was asked to keep (``ds_<name>``) and the extra columns reward functions
log (``extra_<name>``). They are not rows here (their names and types are per run); their
prefixes are (:data:`PREFIXES`): each says the level, table and families of its columns, and
no registered column starts with one. A recorder declares a run's user columns at its first
append and writes every one of them in every append, so each run keeps one schema.

This module imports pyarrow and nothing of torch; the seed classes and functions a column
feeds are named by string.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

__all__ = [
    "CORE",
    "FAMILIES",
    "COMPLETION_INFO_TYPE",
    "Column",
    "GROUP",
    "GROUP_KEY",
    "Level",
    "MAXENT",
    "MESSAGES_TYPE",
    "MESSAGE_TYPE",
    "PREFIXES",
    "Prefix",
    "REGISTRY",
    "TRAINER_METRICS",
    "LIFECYCLE",
    "ATTEMPT_ENDS",
    "LOGP_SEMANTICS",
    "OFFPOLICY_READS",
    "SAMPLING_COLUMNS",
    "LIFECYCLE_KEY",
    "EVENTS",
    "DROP_REASONS",
    "ROW_KEY",
    "STEP",
    "TRL",
    "UNIT_COUNTS",
    "UNIT_KEY",
    "VERL",
    "column",
    "columns",
    "family_of_columns",
    "fed_fields",
    "markdown_table",
    "feeding",
    "names",
    "numbers",
    "prefix_of",
]

Level = Literal["group", "completion", "token", "step", "record"]
GROUP, STEP = "groups", "steps"  # the rollout tables
TRAINER_METRICS = "trainer_metrics"  # a record table: a trainer's logged figures
LIFECYCLE = "lifecycle"  # a record table: what became of each stored group
ATTEMPT_ENDS = "attempt_ends"  # a record table: the writers that ended their attempt
# A lifecycle event, and why a group was dropped (``docs/commit-protocol.md``, "Lifecycle").
EVENTS = ("trained", "dropped")
DROP_REASONS = ("zero_std", "stale", "filtered", "failed", "aborted")
CORE, MAXENT, TRL, VERL = "core", "maxent", "trl", "verl"
FAMILIES = (CORE, MAXENT, TRL, VERL)

# Keys. A unit is one step of one rank and kind (one append); a row of the group table is one
# group row of a unit; a group is every row, of any rank, with its step, kind and group_id
# (a trainer that spreads a prompt's completions over ranks writes one row per rank).
UNIT_KEY = ("step", "rank", "kind")
ROW_KEY = (*UNIT_KEY, "group_index")
# The stored group a ``lifecycle`` record names: its columns, parallel to ROW_KEY.
LIFECYCLE_KEY = ("rollout_step", "rollout_rank", "rollout_kind", "group_index")
GROUP_KEY = ("step", "kind", "group_id")
# What the commit log's summary of a step file counts of its step rows (what `inspect` prints):
# the unit key, the groups and completions, and the run config (``store/history/log.py``).
UNIT_COUNTS = (*UNIT_KEY, "num_groups", "num_samples", "config")


# The off-policy contract (``docs/arrow-layout.md``, "Off-policy data"): what the behaviour
# log-probs are, and the column of each per-completion sampling parameter.
LOGP_SEMANTICS = ("raw", "processed")
SAMPLING_COLUMNS = {
    "temperature": "sampling_temperature",
    "top_p": "sampling_top_p",
    "top_k": "sampling_top_k",
    "min_p": "sampling_min_p",
}

# What the off-policy analytics read of a group row (``analytics/offpolicy.py``): where it
# sits, its versions, the trainer's and the sampler's log-probs, the counted tokens, the kept
# sets and top-k log-probs, and their semantics.
OFFPOLICY_READS = (
    "step", "rank", "kind", "group_index", "num_completions", "completion_policy_version",
    "behavior_token_logp", "sampling_token_logp", "tool_mask", "kept_token_ids",
    "topk_token_ids", "topk_token_logp", "behavior_logp_semantics",
)  # fmt: skip


def _list(kind: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", kind, nullable=False))


# Completion info in the group table: token ids live in `completion_ids`, not here.
COMPLETION_INFO_TYPE = pa.struct(
    [
        pa.field("finish_reason", pa.string()),
        pa.field("stop_reason", pa.string()),
        pa.field("truncated", pa.bool_()),
        pa.field("token_count", pa.int32()),
        pa.field("extra", pa.string()),
    ]
)
# A chat message: role and text content; any other key of the message (a name, tool calls,
# non-text content) as a JSON object in `extra`.
MESSAGE_TYPE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("extra", pa.string()),
    ]
)
MESSAGES_TYPE = _list(MESSAGE_TYPE)


@dataclass(frozen=True)
class Column:
    """One stored column.

    Parameters
    ----------
    name, type, level:
        The column's name, its Arrow type (list children non-nullable) and its level.
    table:
        ``"groups"`` or ``"steps"``.
    families:
        The run layouts that carry it (``("core",)`` for every run).
    doc:
        What it means (the column table of ``docs/arrow-layout.md``).
    required:
        Every row has a value; the column is never absent.
    identity:
        Part of where a row or a completion sits in the run (step, rank, kind, group index,
        group id and size, completion index), not a value about it.
    dictionary, statistics:
        Parquet dictionary encoding (repeated strings only: on token ids and log-probs it
        makes writes ~4x slower for little gain) and column statistics (what readers filter
        on).
    alias:
        Its name in the ``samples`` view (completion level; default: the name).
    in_samples:
        Whether the ``samples`` view (one row per completion) carries it: a group-level value
        is repeated on each of the group's rows unless that would only repeat bulk
        (``prompt_ids``) or a count the view itself spells out (``num_completions``).
    feeds:
        ``"Class.field"`` of the seed record it is read back into (a tuple when it feeds
        several), if any.
    upgrade:
        How a file of an older schema that lacks it gets it (``docs/arrow-layout.md``).
    merge:
        How the values of several ranks of one step merge into the step's (step table):
        ``"sum"``, ``"min"``, ``"max"``, ``"mean:<weight column>"`` or
        ``"pooled_std:<weight column>"`` (``docs/formulas.md``, "Step statistics").
    logged_as:
        The key a trainer's log gives the value under (TRL's ``log_history``; an evaluation's
        with TRL's ``eval_`` prefix), for columns of a record table that copy one.
    kept_set:
        Per-token sets of ids stored gap-coded (:mod:`.keptsets`): written byte-stream split
        (the gaps' low and high bytes compress apart, to about 1.3 bytes per id at top-k 64 of
        32k), checked against the token counts of ``completion_ids``.
    """

    name: str
    type: pa.DataType
    level: Level
    table: str
    families: tuple[str, ...]
    doc: str
    required: bool = False
    identity: bool = False
    dictionary: bool = False
    statistics: bool = False
    alias: str | None = None
    in_samples: bool = True
    feeds: str | tuple[str, ...] | None = None
    upgrade: str | None = None
    merge: str | None = None
    logged_as: str | None = None
    kept_set: bool = False

    @property
    def fed(self) -> tuple[str, ...]:
        """The ``"Class.field"`` entries this column feeds (none, one or several)."""
        if self.feeds is None:
            return ()
        return (self.feeds,) if isinstance(self.feeds, str) else tuple(self.feeds)

    @property
    def field(self) -> pa.Field:
        """The Arrow field (nullable unless required)."""
        return pa.field(self.name, self.type, nullable=not self.required)

    @property
    def sample_alias(self) -> str:
        """Its column name in the ``samples`` view."""
        return self.alias or self.name

    @property
    def leaf(self) -> pa.DataType:
        """The type of its values inside every list level (``float32`` of a per-token float)."""
        kind = self.type
        while pa.types.is_list(kind) or pa.types.is_large_list(kind):
            kind = kind.value_type
        return kind

    @property
    def byte_stream_split(self) -> bool:
        """Per-token floats compress better byte-stream split, at no extra cost."""
        return self.level == "token" and pa.types.is_floating(self.leaf)

    def in_layout(self, families: Iterable[str]) -> bool:
        """Whether a run of ``families`` carries this column."""
        return any(f in self.families for f in families)


def _g(name: str, kind: pa.DataType, level: Level, doc: str, *families: str, **kw: Any) -> Column:
    return Column(name, kind, level, GROUP, families or (CORE,), doc, **kw)


def _s(name: str, kind: pa.DataType, doc: str, *families: str, **kw: Any) -> Column:
    return Column(name, kind, "step", STEP, families or (CORE,), doc, **kw)


def _m(name: str, kind: pa.DataType, doc: str, **kw: Any) -> Column:
    return Column(name, kind, "record", TRAINER_METRICS, (CORE,), doc, **kw)


def _lc(name: str, kind: pa.DataType, doc: str, **kw: Any) -> Column:
    return Column(name, kind, "record", LIFECYCLE, (CORE,), doc, **kw)


def _end(name: str, kind: pa.DataType, doc: str, **kw: Any) -> Column:
    return Column(name, kind, "record", ATTEMPT_ENDS, (CORE,), doc, **kw)


_f64, _f32, _i32, _i64, _str = pa.float64(), pa.float32(), pa.int32(), pa.int64(), pa.string()

REGISTRY: tuple[Column, ...] = (
    # The order is the layout's: the 2.0 columns as they were (plain readers see one column
    # order in every file of a run), then the later ones.
    # ------------------------------------------------------------------ group table
    _g("step", _i64, "group", "optimizer step at which the group was generated", required=True,
       statistics=True, identity=True),
    _g("rank", _i32, "group", "process that wrote the row", required=True, statistics=True,
       identity=True),
    _g("kind", _str, "group", '`"train"`, `"eval"`, or another lowercase name '
       "(`[a-z][a-z0-9_]{0,31}`)", required=True, dictionary=True, statistics=True,
       upgrade="from the file name", identity=True),
    _g("group_index", _i32, "group", "row index within its append", required=True,
       statistics=True, identity=True),
    _g("group_id", _str, "group", "run-wide identity of the prompt group: rows of one step and "
       "kind with the same `group_id` are parts of one group (default "
       '`"{step}.{rank}.{group_index}"`)', required=True, dictionary=True,
       upgrade='"{step}.{rank}.{group_index}"', identity=True),
    _g("group_size", _i32, "group", "K of the whole group (more than this row's when a trainer "
       "spread the group over ranks)", required=True, upgrade="the row's completion count",
       identity=True),
    _g("num_completions", _i32, "group", "K_i of this row: queries never decode strings to "
       "count completions", required=True, upgrade="the row's completion count",
       in_samples=False, identity=True),
    _g("prompt", _str, "group", "the prompt, when it is text", dictionary=True,
       feeds="GenerationBatch.prompts"),
    _g("prompt_messages", MESSAGES_TYPE, "group", "the prompt, when it is a chat (exactly one "
       "of `prompt` / `prompt_messages` is set)", feeds="GenerationBatch.prompts"),
    _g("answer", _str, "group", "the reference answer", dictionary=True,
       feeds="GenerationBatch.answers"),
    _g("prompt_ids", _list(_i32), "group", "exact prompt token ids", in_samples=False),
    _g("completions", _list(_str), "completion", "completion text (for a chat completion, the "
       "assistant text)", required=True, alias="completion",
       feeds="GenerationBatch.grouped_completions"),
    _g("completion_messages", _list(MESSAGES_TYPE), "completion", "chat completions as "
       "messages, null for text completions", alias="completion_message",
       feeds="GenerationBatch.grouped_completions"),
    _g("completion_index", _list(_i32), "completion", "each completion's index in the whole "
       "group", upgrade="counted", identity=True),
    _g("completion_ids", _list(_list(_i32)), "token", "exact completion token ids (what was "
       "scored)"),
    _g("completion_info", _list(COMPLETION_INFO_TYPE), "completion", "generator metadata; "
       "other keys as JSON in `extra` (spread into its fields in `samples`)",
       feeds="GenerationBatch.grouped_completion_info"),
    _g("ref_meta", _list(_str), "completion", "per-completion reference metadata, JSON",
       MAXENT, feeds=("GenerationBatch.grouped_ref_meta", "RewardComputation.ref_logprob_meta")),
    _g("total_utils", _list(_f64), "completion", "U_i, the weighted utility "
       "(`docs/formulas.md` §3.1; NaN where no reward function scored the completion)",
       alias="total_util", feeds="RewardComputation.total_utils"),
    _g("reward_names", _list(_str), "group", "the reward functions of this row",
       dictionary=True, upgrade="from the 1.x `rewards` struct",
       feeds="RewardComputation.per_reward_values"),
    _g("reward_values", _list(_list(_f64)), "completion", "per completion, one raw value per "
       "name in `reward_names` (NaN where a function gave none); `reward_<name>` in `samples`",
       upgrade="from the 1.x `rewards` struct", feeds="RewardComputation.per_reward_values"),
    _g("advantages", _list(_f64), "completion", "A_i (§3.2)", alias="advantage",
       feeds="RewardComputation.advantage"),
    _g("q", _list(_f64), "completion", "the q-distribution (§3.4)", MAXENT,
       feeds="RewardComputation.q_distribution"),
    _g("weights", _list(_f64), "completion", "MaxEnt weights w_i (§3.6)", MAXENT,
       alias="weight"),
    _g("ref_logp_sum_raw", _list(_f64), "completion", "R_i, the summed reference log-prob",
       feeds="ReferenceLogprobs.ref_logp_sum_raw"),
    _g("ref_tok_counts", _list(_i32), "completion", "T_i, the scored tokens",
       alias="ref_tok_count", feeds="ReferenceLogprobs.ref_tok_counts"),
    _g("ref_token_logp", _list(_list(_f32)), "token", "per-token reference log-probs",
       feeds="ReferenceLogprobs.ref_token_logp"),
    _g("behavior_logp_sum", _list(_f64), "completion", "summed behaviour (sampler) log-probs"),
    _g("behavior_token_logp", _list(_list(_f32)), "token", "per-token behaviour log-probs, one "
       "per generated token"),
    _g("policy_entropy_sum", _list(_f64), "completion", "summed policy entropy over the "
       "completion's tokens", MAXENT, feeds="SequenceScores.policy_entropy_sum"),
    _g("seed_semantic_entropy", _f64, "group", "SEED-GRPO group entropy (§3.3)", MAXENT,
       feeds="RewardComputation.seed_semantic_entropies"),
    _g("seed_advantage_scale", _f64, "group", "SEED-GRPO group scale (§3.3)", MAXENT,
       feeds="RewardComputation.seed_advantage_scales"),
    # ------------------------------------------------------------------ core (2.1)
    _g("round", _i32, "group", "the generation round within the step (0 when a step is one "
       "round; TRL with `steps_per_generation` below gradient accumulation, or an evaluation "
       "in several batches, makes several): batch-level normalisations are per round",
       identity=True, upgrade="0"),
    # ------------------------------------------------------------------ TRL and verl (2.1)
    _g("token_advantages", _list(_list(_f32)), "token", "per-token advantages (a TRL subclass "
       "that gives them; verl's `advantages`)", TRL, VERL),
    _g("importance_sampling_ratio", _list(_list(_f32)), "token", "TRL's vLLM importance "
       "sampling ratio, per token", TRL),
    _g("sequence_importance_sampling_ratio", _list(_f32), "completion", "TRL's vLLM "
       "importance sampling ratio, per sequence", TRL),
    _g("tool_mask", _list(_list(pa.int8())), "token", "TRL's tool mask (1: a token the model "
       "generated, 0: a tool's output)", TRL),
    _g("sampling_token_logp", _list(_list(_f32)), "token", "the rollout engine's own per-token "
       "log-probs: verl's `rollout_log_probs`, TRL's `sampling_per_token_logps` (vLLM or a "
       "`rollout_func`)", TRL, VERL),
    _g("token_returns", _list(_list(_f32)), "token", "verl's `returns`", VERL),
    _g("token_values", _list(_list(_f32)), "token", "verl's `values` (critic)", VERL),
    _g("verl_row", _list(_i32), "completion", "each completion's row in the `DataProto` it "
       "came from (`to_dataproto` restores the order)", VERL),
    _g("sample_prompt_ids", _list(_list(_i32)), "token", "per-completion prompt ids, when a "
       "group's rows had different prompts", VERL),
    # ------------------------------------------------------------------ context (2.2)
    _g("example_id", _str, "group", "the dataset example the prompt came from: its index in "
       "the dataset, as text (`CAST(example_id AS BIGINT)`), or the value of a named id column "
       "(TRL: `RolloutRecorder(example_id=...)`; verl: the `index` key)"),
    _g("stream_index", _i64, "group", "the prompt's position in the run's prompt stream (0, 1, "
       "...): what a consumer's cursor counts, so `store.frontier()` can say which prompts are "
       "consumed and which are in flight (`docs/commit-protocol.md`, \"Exactly once\")"),
    # ------------------------------------------------------------------ off-policy (2.2)
    _g("completion_policy_version", _list(_i64), "completion", "the policy version (optimizer "
       "updates the generating policy had) each completion was generated with; a partial "
       "rollout's: the version its generation began with (its first run's)"),
    _g("version_run_starts", _list(_list(_i32)), "completion", "partial rollouts: per "
       "completion, the token index where each run of one policy version starts (0 first, "
       "increasing, below the token count); empty for a completion made by one version"),
    _g("version_run_versions", _list(_list(_i64)), "completion", "the policy version of each "
       "run in `version_run_starts` (parallel to it; non-decreasing, the first is "
       "`completion_policy_version`)"),
    _g("behavior_logp_semantics", _list(_str), "completion", "what the sampler's log-probs "
       "(`sampling_token_logp` where stored, else `behavior_token_logp`) are: `raw` (the model's log-softmax at "
       "temperature 1, before any sampling processor) or `processed` (of the distribution "
       "sampled from: after temperature, top-k, top-p and min-p, renormalised over the kept "
       "set)", dictionary=True, alias="logp_semantics"),
    _g("sampling_temperature", _list(_f64), "completion", "the sampling temperature of each "
       "completion"),
    _g("sampling_top_p", _list(_f64), "completion", "its nucleus (top-p) mass (1.0: off)"),
    _g("sampling_top_k", _list(_i32), "completion", "its top-k cut (0: off)"),
    _g("sampling_min_p", _list(_f64), "completion", "its min-p cut (0.0: off)"),
    _g("kept_token_ids", _list(_list(pa.large_list(pa.field("item", _i32, nullable=False)))),
       "token", "per token, the vocabulary ids the sampler kept after top-k / top-p / min-p "
       "(the set it renormalised over and drew from), ascending and gap-coded: the first id, "
       "then each id minus the one before (`maxent_arrow/arrow/keptsets.py` decodes; in SQL a "
       "running sum); innermost `large_list` (a step's kept ids pass int32 offsets)",
       kept_set=True),
    _g("topk_token_ids", _list(_list(_list(_i32))), "token", "per token, the ids of the "
       "generator's top-k log-probs (vLLM's `logprobs=k`), most likely first"),
    _g("topk_token_logp", _list(_list(_list(_f32))), "token", "their log-probs (parallel to "
       "`topk_token_ids`; with the semantics of `behavior_logp_semantics`)"),
    # ------------------------------------------------------------------ step table
    _s("step", _i64, "identity", required=True, statistics=True),
    _s("rank", _i32, "identity", required=True, statistics=True),
    _s("kind", _str, "identity", required=True),
    _s("num_groups", _i32, "group rows of the step and rank", required=True, merge="sum"),
    _s("num_samples", _i32, "completions of the step and rank", required=True, merge="sum"),
    _s("created_at", pa.timestamp("us", tz="UTC"), "when the step row was made"),
    _s("policy_version", _i64, "which policy generated the step"),
    _s("reward_mean", _f64, "mean of the scored utilities (`RewardMoments.mean`)",
       feeds="RewardMoments.mean", merge="mean:num_scored"),
    _s("reward_std", _f64, "population std of the scored utilities (`RewardMoments.std`)",
       feeds="RewardMoments.std", merge="pooled_std:num_scored"),
    _s("min_length", _f64, "`LengthStats.min_length`", feeds="LengthStats.min_length",
       merge="min"),
    _s("mean_length", _f64, "`LengthStats.mean_length`", feeds="LengthStats.mean_length",
       merge="mean:num_samples"),
    _s("max_length", _f64, "`LengthStats.max_length`", feeds="LengthStats.max_length",
       merge="max"),
    _s("clipped_ratio", _f64, "`LengthStats.clipped_ratio` (completions cut at the length cap)",
       feeds="LengthStats.clipped_ratio", merge="mean:num_samples"),
    _s("min_terminated", _f64, "`LengthStats.min_terminated` (NULL when none terminated)",
       feeds="LengthStats.min_terminated", merge="min"),
    _s("mean_terminated", _f64, "`LengthStats.mean_terminated` (NULL when none terminated)",
       feeds="LengthStats.mean_terminated", merge="mean:num_terminated"),
    _s("max_terminated", _f64, "`LengthStats.max_terminated` (NULL when none terminated)",
       feeds="LengthStats.max_terminated", merge="max"),
    _s("ref_logp_mean", _f64, "reference summary (`ReferenceLogprobs.ref_logp_mean`)",
       feeds="ReferenceLogprobs.ref_logp_mean"),
    _s("avg_completion_tokens", _f64, "reference summary "
       "(`ReferenceLogprobs.avg_completion_tokens`)",
       feeds="ReferenceLogprobs.avg_completion_tokens"),
    _s("total_loss", _f64, "`LossScalarBundle`", MAXENT, feeds="LossScalarBundle.total_loss"),
    _s("policy_loss", _f64, "`LossScalarBundle`", MAXENT, feeds="LossScalarBundle.policy_loss"),
    _s("clip_loss", _f64, "`LossScalarBundle`", MAXENT, feeds="LossScalarBundle.clip_loss"),
    _s("kl_loss", _f64, "`LossScalarBundle`", MAXENT, feeds="LossScalarBundle.kl_loss"),
    _s("weighted_kl_loss", _f64, "`LossScalarBundle`", MAXENT,
       feeds="LossScalarBundle.weighted_kl_loss"),
    _s("kl_value", _f64, "`BatchDiagnostics.kl_value`", feeds="BatchDiagnostics.kl_value"),
    _s("clip_ratio", _f64, "`BatchDiagnostics`", MAXENT, feeds="BatchDiagnostics.clip_ratio"),
    _s("clip_ratio_low_mean", _f64, "`BatchDiagnostics`", MAXENT,
       feeds="BatchDiagnostics.clip_ratio_low_mean"),
    _s("clip_ratio_low_min", _f64, "`BatchDiagnostics`", MAXENT,
       feeds="BatchDiagnostics.clip_ratio_low_min"),
    _s("clip_ratio_high_mean", _f64, "`BatchDiagnostics`", MAXENT,
       feeds="BatchDiagnostics.clip_ratio_high_mean"),
    _s("clip_ratio_high_max", _f64, "`BatchDiagnostics`", MAXENT,
       feeds="BatchDiagnostics.clip_ratio_high_max"),
    _s("clip_ratio_region_mean", _f64, "`BatchDiagnostics`", MAXENT,
       feeds="BatchDiagnostics.clip_ratio_region_mean"),
    _s("kl_length_buckets", _list(_str), "the labels of the two bucket lists below"),
    _s("kl_per_token_by_len_bucket", _list(_f64), "`BatchDiagnostics` bucket dict as a list "
       "parallel to the labels (no map columns: Hugging Face `datasets` cannot read them)",
       feeds="BatchDiagnostics.kl_per_token_by_len_bucket"),
    _s("kl_token_count_by_len_bucket", _list(_f64), "likewise",
       feeds="BatchDiagnostics.kl_token_count_by_len_bucket"),
    _s("entropy_bonus_scale", _f64, "`RewardComputation.entropy_bonus_scale`", MAXENT,
       feeds="RewardComputation.entropy_bonus_scale"),
    _s("seed_alpha_effective", _f64, "`RewardComputation.seed_alpha_effective`", MAXENT,
       feeds="RewardComputation.seed_alpha_effective"),
    _s("seed_max_possible_entropy", _f64, "`RewardComputation.seed_max_possible_entropy`",
       MAXENT, feeds="RewardComputation.seed_max_possible_entropy"),
    _s("config", _str, "the replay contract, `RunConfig` as JSON "
       "(`maxent_arrow/rollout/config.py`)"),
    # ------------------------------------------------------------------ step table (2.1)
    _s("num_scored", _i32, "completions some reward function scored (the others are "
       "*unscored*: NaN utility, left out of the reward statistics)", merge="sum"),
    # ------------------------------------------------------------------ step table (2.2)
    _s("metric_names", _list(_str), "scalar metrics the reward functions logged while scoring "
       "the step's rounds (TRL's `log_metric`), by name", TRL),
    _s("metric_values", _list(_f64), "each name's mean over the values logged on this rank "
       "during the step (parallel to `metric_names`)", TRL),
    _s("metric_counts", _list(_i32), "how many values each mean is over (TRL logs the "
       "count-weighted mean over ranks)", TRL),
    # ------------------------------------------------------------------ trainer_metrics
    _m("optimizer_step", _i64, "the optimizer step the record closes: the trainer's step "
       "counter after the update (TRL's logged `step`); for an evaluation, the step it ran at",
       required=True, identity=True, statistics=True),
    _m("kind", _str, '`"train"` or `"eval"`', required=True, identity=True),
    _m("step", _i64, "the rollout step (`steps.step`) whose data the record's last optimizer "
       "step trained on (an evaluation: its own step): the join key with `groups` and `steps`",
       identity=True, statistics=True),
    _m("first_step", _i64, "the rollout step whose data the first optimizer step averaged "
       "trained on (`step` when one round fed them all)", identity=True),
    _m("averaged_steps", _i32, "optimizer steps the figures average over: 1 with "
       "`logging_steps=1` (per step); 0 for an evaluation"),
    _m("loss_batches", _i32, "loss computations (micro-batches of every iteration; an "
       "evaluation's batches) averaged into `kl`, `entropy` and the clip ratios"),
    _m("rounds", _i32, "generation rounds averaged into the generation figures of `metric_*` "
       "(rewards, lengths, `log_metric` values)"),
    _m("created_at", pa.timestamp("us", tz="UTC"), "when the record was made"),
    _m("loss", _f64, "the training loss: mean over the averaged optimizer steps of each step's "
       "mean over its micro-batches and processes (an evaluation: over its batches)",
       logged_as="loss"),
    _m("grad_norm", _f64, "the gradient norm of the last averaged optimizer step, before "
       "clipping (not an average)", logged_as="grad_norm"),
    _m("learning_rate", _f64, "the learning rate of the last averaged optimizer step (HF's "
       "Trainer reads it before its scheduler steps)", logged_as="learning_rate"),
    _m("epoch", _f64, "the trainer's epoch counter at the log", logged_as="epoch"),
    _m("kl", _f64, "mean per-token KL to the reference (TRL: k3, β > 0), averaged over "
       "`loss_batches`", logged_as="kl"),
    _m("entropy", _f64, "mean per-token policy entropy, averaged over `loss_batches`",
       logged_as="entropy"),
    _m("clip_ratio_low_mean", _f64, "share of tokens clipped at 1 − ε (negative advantage), "
       "averaged over `loss_batches`", logged_as="clip_ratio/low_mean"),
    _m("clip_ratio_low_min", _f64, "the least per-completion share of low-clipped tokens, "
       "averaged over `loss_batches`", logged_as="clip_ratio/low_min"),
    _m("clip_ratio_high_mean", _f64, "share of tokens clipped at 1 + ε_high (positive "
       "advantage), averaged", logged_as="clip_ratio/high_mean"),
    _m("clip_ratio_high_max", _f64, "the largest per-completion share of high-clipped tokens, "
       "averaged", logged_as="clip_ratio/high_max"),
    _m("clip_ratio_region_mean", _f64, "share of tokens clipped either way, averaged",
       logged_as="clip_ratio/region_mean"),
    _m("metric_names", _list(_str), "every other figure of the log, by the trainer's name "
       "(TRL's `reward`, `rewards/<f>/mean`, `completions/mean_length`, `log_metric` names, "
       "...; an evaluation's without the `eval_` prefix)"),
    _m("metric_values", _list(_f64), "their values, parallel to `metric_names` (NaN where the "
       "trainer logged None)"),
    # ------------------------------------------------------------------ lifecycle
    _lc("step", _i64, "the trainer step the decision was made at: a resume at step s "
        "supersedes the events of steps >= s of earlier trainer attempts", required=True,
        identity=True, statistics=True),
    _lc("event", _str, '`"trained"` (the group was in the batch of trainer step `step`) or '
        '`"dropped"` (it never will be: see `reason`)', required=True),
    _lc("reason", _str, "why a group was dropped: `zero_std` (all its rewards equal: no "
        "advantage), `stale` (older than the staleness bound), `filtered` (a trainer's filter), "
        "`failed` (its generation or scoring failed), `aborted` (the run stopped with it in "
        "flight); NULL for `trained`"),
    _lc("rollout_step", _i64, "the stored group: its `groups.step`", required=True,
        identity=True),
    _lc("rollout_rank", _i32, "its `groups.rank`", required=True, identity=True),
    _lc("rollout_kind", _str, "its `groups.kind`", required=True, identity=True),
    _lc("group_index", _i32, "its `groups.group_index`", required=True, identity=True),
    _lc("stream_index", _i64, "its `groups.stream_index` (the prompt's position in the stream), "
        "when the producer numbered the stream"),
    _lc("created_at", pa.timestamp("us", tz="UTC"), "when the decision was recorded"),
    # ------------------------------------------------------------------ attempt_ends
    # What tells a finished attempt from a crashed one: a row per writer that ended its
    # attempt (its store's `checkpoint()` at the run's end, or a `with` block left without an
    # exception); the `attempt` column names the attempt, as in every record table.
    _end("ended_at", pa.timestamp("us", tz="UTC"), "when the writer ended the attempt",
         required=True),
    _end("host", _str, "the host of the process that ended it"),
    _end("pid", _i64, "that process's id"),
)  # fmt: skip

_BY_NAME: dict[tuple[str, str], Column] = {(c.table, c.name): c for c in REGISTRY}
if len(_BY_NAME) != len(REGISTRY):  # pragma: no cover - a registry edit that breaks it
    raise RuntimeError("column registry: a (table, name) is declared twice")


@dataclass(frozen=True)
class Prefix:
    """The columns of a run whose names only its user knows (:data:`PREFIXES`): every column
    named ``prefix + <name>`` is at ``level`` in ``table``, written by ``families``' writers."""

    prefix: str
    level: Level
    table: str
    families: tuple[str, ...]
    doc: str


PREFIXES: tuple[Prefix, ...] = (
    Prefix("ds_", "group", GROUP, (CORE,), "a dataset column the recorder was asked to keep "
           "(TRL: `record_columns=[...]`), one value per group, with the dataset's own Arrow "
           "type (declared from the dataset's features when the recorder starts)"),
    Prefix("extra_", "completion", GROUP, (TRL,), "a column reward functions logged with TRL's "
           "`log_extra`: `list<bool>`, `list<double>` (any number) or `list<string>` (text; "
           "any other JSON value as its JSON text), items null where nothing was logged; "
           "typed at the run's first round"),
)  # fmt: skip


def prefix_of(name: str, table: str = GROUP) -> Prefix | None:
    """The :class:`Prefix` a user column ``name`` of ``table`` is declared under, if any."""
    return next((p for p in PREFIXES if p.table == table and name.startswith(p.prefix)), None)


def column(name: str, table: str = GROUP) -> Column:
    """The registry row of column ``name`` of ``table``; ``KeyError`` if it has none."""
    return _BY_NAME[(table, name)]


def columns(
    table: str = GROUP,
    *,
    families: Iterable[str] | None = None,
    level: Level | Iterable[Level] | None = None,
    where: Any = None,
) -> Iterator[Column]:
    """The registry rows of ``table``, in layout order: of a run of ``families`` (default
    all), at ``level`` (one or several), for which ``where(column)`` holds."""
    wanted = None if families is None else tuple(families)
    levels = None if level is None else ({level} if isinstance(level, str) else set(level))
    for c in REGISTRY:
        if c.table != table:
            continue
        if wanted is not None and not c.in_layout(wanted):
            continue
        if levels is not None and c.level not in levels:
            continue
        if where is not None and not where(c):
            continue
        yield c


def names(table: str = GROUP, **filters: Any) -> tuple[str, ...]:
    """The names of :func:`columns` (same filters)."""
    return tuple(c.name for c in columns(table, **filters))


def numbers(table: str = GROUP, *, level: Level = "completion", families=None) -> tuple[str, ...]:
    """Registered value columns (not identity) of ``level`` whose items are numbers: one
    ``int``/``float`` per completion (``level="completion"``) or per token (``"token"``)."""

    def numeric(c: Column) -> bool:
        kind = c.type
        depth = {"group": 0, "step": 0, "record": 0, "completion": 1, "token": 2}[c.level]
        for _ in range(depth):
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                return False
            kind = kind.value_type
        return pa.types.is_integer(kind) or pa.types.is_floating(kind)

    return names(
        table, level=level, families=families, where=lambda c: not c.identity and numeric(c)
    )


def fed_fields(record: str, table: str = GROUP) -> dict[str, str]:
    """``{column: field}`` of the columns of ``table`` that feed seed class ``record``
    (``"GenerationBatch"``), in layout order."""
    out = {}
    for c in columns(table):
        for entry in c.fed:
            owner, _, field = entry.partition(".")
            if owner == record:
                out[c.name] = field
    return out


def feeding(record: str, table: str = GROUP) -> tuple[str, ...]:
    """The columns of ``table`` that feed seed class ``record`` (``"LengthStats"``), in
    layout order."""
    return tuple(fed_fields(record, table))


def _type_text(kind: pa.DataType) -> str:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list<{_type_text(kind.value_type)}>"
    if pa.types.is_struct(kind):
        if kind == COMPLETION_INFO_TYPE:
            return "struct<finish_reason, stop_reason, truncated, token_count, extra>"
        if kind == MESSAGE_TYPE:
            return "struct<role, content, extra>"
        return f"struct<{', '.join(f.name for f in kind)}>"
    return str(kind)


def markdown_table(table: str = GROUP) -> str:
    """The column table of ``docs/arrow-layout.md`` for ``table``, generated from the
    registry (a test checks that the document holds exactly this); the user-column prefixes
    of the table close it."""
    lines = [
        "| column | type | level | families | meaning |",
        "|---|---|---|---|---|",
    ]
    for c in columns(table):
        flags = [w for w, on in (("required", c.required), ("identity", c.identity)) if on]
        kind = _type_text(c.type) + (f", {', '.join(flags)}" if flags else "")
        alias = f" (`{c.alias}` in `samples`)" if c.alias else ""
        feeds = f" Feeds {', '.join(f'`{f}`' for f in c.fed)}." if c.fed else ""
        logged = f" TRL logs it as `{c.logged_as}`." if c.logged_as else ""
        lines.append(
            f"| `{c.name}` | {kind} | {c.level} | {', '.join(c.families)} | "
            f"{c.doc}{alias}.{feeds}{logged} |"
        )
    for p in PREFIXES:
        if p.table == table:
            lines.append(
                f"| `{p.prefix}<name>` | per run | {p.level} | {', '.join(p.families)} | "
                f"user column: {p.doc}. |"
            )
    return "\n".join(lines) + "\n"


def family_of_columns(present: Iterable[str], table: str = GROUP) -> set[str]:
    """The families a set of column names implies: ``core`` and the families of every
    registered non-core column present (a column in several families implies none alone)."""
    found = {CORE}
    for name in present:
        c = _BY_NAME.get((table, name))
        if c is not None and CORE not in c.families and len(c.families) == 1:
            found.add(c.families[0])
    return found
