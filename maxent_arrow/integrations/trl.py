"""Record the rollouts of an unmodified ``trl.GRPOTrainer`` into a rollout store
(``pip install 'maxent-arrow[trl]'``; written against TRL 1.16, whose surface we rely on is
declared in :mod:`.trl_contract`).

:class:`RecordingGRPOTrainer` is ``trl.GRPOTrainer`` with :class:`RolloutRecorder` mixed in:
pass ``rollout_store=`` (a path, URI or :class:`~maxent_arrow.store.RolloutStore`) and train as
usual. Every generation round is written once, as one append per process (each process writes
its own rank; nothing is gathered to one process to be written), keyed by the optimizer step
(``state.global_step``) at which it was generated: with ``steps_per_generation`` or
``num_iterations`` > 1 a round serves several optimizer steps and is stored under the first.
Evaluation rounds are stored as ``kind="eval"``, one append per evaluation. With each training
step's append goes the micro-batch split TRL drew for each of its rounds (a ``trl_split``
record, :mod:`.trl_split`: the permutation TRL's ``_prepare_inputs`` shuffles the round with,
drawn ahead by :func:`~.trl_contract.next_shuffle`, about 20 µs), which the store-fed trainer
replays.

What a round holds is the group layout of ``docs/arrow-layout.md``, built by
:mod:`.trl_tables` from TRL's output dict (:func:`trl_group_table` is the same path for a
round held outside a trainer). The step row carries :class:`~maxent_arrow.rollout.RunConfig`
with TRL's settings (:mod:`.trl_config`), so :func:`~maxent_arrow.rollout.recompute`
reproduces TRL's advantages from a stored step.

Cost to the training step: only :func:`~.trl_tables.host_round`, one numpy mask select per
tensor (about 0.5 ms of CPU for 64 completions of 128 tokens, less than TRL's own completions
Parquet); :func:`~.trl_tables.round_table` (the Arrow columns), the step row and the durable
append run on a background thread (``background=False``: all on the loop).
``benchmarks/bench_integrations.py`` measures both against TRL's logging.

Partial groups: TRL's sampler gives each process consecutive rows of the global generation
batch, so a prompt's completions can be spread over processes, and each process then writes
its part. Readers see whole groups through :func:`~maxent_arrow.rollout.reassemble`, which
merges the parts of a step by ``group_id`` in ``completion_index`` order.

The step row holds ``policy_version`` (``global_step`` at generation) and the
``log_metric`` values (``metric_names`` / ``metric_values`` / ``metric_counts``). Each of
TRL's log calls becomes a ``trainer_metrics`` record (:func:`trl_metrics_row`), joined to the
rollout step its data came from by the step rule (:func:`rollout_step`).

The recorder overrides TRL's private ``_generate_and_score_completions`` (its output dict)
and ``_calculate_rewards`` (the per-function rewards, prompts and completions, and what the
reward functions logged, TRL's ``_pending_extra_logs`` / ``_pending_metrics``), and the
Trainer's public ``log``, ``train`` and ``evaluate`` (:data:`~.trl_contract.OVERRIDDEN_METHODS`).
What it keeps between rounds is one object on the trainer, ``rollout_state``
(:class:`RecorderState`).

**Resumes and re-runs** (``docs/integrations.md``, "Resume and re-run"). Each ``train()`` call
is an attempt of the run (:mod:`maxent_arrow.store.history.attempts`), begun in the store before its
first step. ``train(resume_from_checkpoint=...)`` (``True``: the last checkpoint in
``output_dir``; or a path) resumes the store at the checkpoint's ``global_step`` g, read from
its ``trainer_state.json``: TRL's first round after the resume is generated at g and stored as
step g (the step rule below), so the stored steps >= g of earlier attempts, rounds TRL
regenerates, are superseded, and readers see what the resumed run trained on. A fresh
``train()`` into a store that holds steps of an earlier run is refused before its first step
(a :class:`~maxent_arrow.errors.StoreError` naming the choices: resume, or a new run
directory); ``rollout_if_exists="new_attempt"`` records it as a new attempt that supersedes
the earlier run, ``"resume"`` continues after its last step.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import registry as R
from maxent_arrow.arrow.registry import CORE, TRL
from maxent_arrow.errors import (
    ArgumentError,
    LayoutError,
    MissingExtraError,
    SchemaError,
    StoreError,
)
from maxent_arrow.integrations.appender import Appender
from maxent_arrow.integrations.context import (
    DATASET,
    EXTRA,
    INDEX_KEY,
    UserColumns,
    answer_text,
    dataset_types,
    with_index,
)
from maxent_arrow.integrations.steps import step_row
from maxent_arrow.integrations.trl_config import trl_offpolicy, trl_run_config
from maxent_arrow.integrations.trl_contract import (
    METRIC_COUNTS,
    TRL_VERSION,
    TrlOutput,
    next_shuffle,
)
from maxent_arrow.integrations.trl_split import SPLIT_TABLE, split_rows
from maxent_arrow.integrations.trl_tables import (
    RoundContext,
    RoundValues,
    concat_rounds,
    host_round,
    round_table,
)
from maxent_arrow.rollout import (
    METRICS_KEY,
    RolloutBatch,
    declare_families,
    trainer_metrics_table,
)
from maxent_arrow.store import RolloutStore, Unit
from maxent_arrow.store.history.attempts import IF_EXISTS, IfExists

try:
    from transformers import TrainerState
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOTrainer  # pyright: ignore[reportPrivateImportUsage] - trl's lazy module
except ImportError:  # pragma: no cover - the extra is installed where this module is used
    raise MissingExtraError("trl", "trl") from None

__all__ = [
    "Capture",
    "LOGGED_STEP_OFFSET",
    "PendingStep",
    "RecorderState",
    "RecordingGRPOTrainer",
    "RolloutRecorder",
    "checkpoint_step",
    "logged_kind",
    "register_trl_log",
    "rollout_step",
    "trl_group_table",
    "trl_metrics_row",
    "trl_trainer_metrics",
]


# ---------------------------------------------------------------------------- one round
def trl_group_table(
    outputs: Mapping[str, Any],
    context: RoundContext,
    values: RoundValues,
    *,
    first_index: int,
    rewards: Any,
    completion_lengths: Any = None,
) -> pa.Table:
    """The group rows of one generation round of one process, from TRL's tensors: the
    recorder's path (:func:`~.trl_tables.host_round`, then :func:`~.trl_tables.round_table`)
    as one call, for a round held outside a trainer.

    ``outputs`` is the dict ``_generate_and_score_completions`` returned on this process (B
    rows, B = ``len(values.prompts)``; read by :class:`~.trl_contract.TrlOutput`);
    ``context`` (:class:`~.trl_tables.RoundContext`) is where the round is stored and what
    holds for all its completions; ``values`` (:class:`~.trl_tables.RoundValues`) the per-row
    Python values: prompts, completions, answers, example ids, dataset and ``log_extra``
    columns. ``first_index`` (the global row of this process's first row in the round's
    generation batch), ``rewards`` (the raw ``[B, F]`` per-function rewards) and
    ``completion_lengths`` (token counts, for when TRL's mask zeroes truncated rows) are
    :func:`~.trl_tables.host_round`'s.
    """
    host = host_round(
        TrlOutput.read(outputs, where="trl_group_table: outputs"),
        context,
        rows=len(values.prompts),
        first_index=first_index,
        rewards=rewards,
        completion_lengths=completion_lengths,
    )
    return round_table(host, values, context)


# ---------------------------------------------------------------------------- TRL's log
# The step-numbering rule (docs/integrations.md, "Step numbers"): a training round generated
# at TRL's global_step s is stored as step s, and TRL logs what it measured of it under the
# step its update completes, s + 1; an evaluation round is stored and logged at its own step.
LOGGED_STEP_OFFSET = {"train": 1, "eval": 0}
# TRL's log keys of the record table's figure columns (from the registry).
_FIGURES = {c.logged_as: c.name for c in R.columns(R.TRAINER_METRICS) if c.logged_as}


def logged_kind(entry: Mapping[str, Any]) -> str | None:
    """Which kind of record a ``log_history`` entry is: ``"train"`` (a training log, it has
    ``loss``), ``"eval"`` (an evaluation, ``eval_`` keys) or ``None`` (the end-of-training
    summary, ``train_runtime`` and the like: not a record)."""
    if "loss" in entry:
        return "train"
    if any(key.startswith("eval_") for key in entry):
        return "eval"
    return None


def rollout_step(optimizer_step: int, kind: str, train_steps: Sequence[int]) -> int | None:
    """The stored rollout step whose data TRL's logged step ``optimizer_step`` trained on:
    for training, the latest round generated at a global_step of at most
    ``optimizer_step - 1`` (``train_steps``: the run's stored train steps, ascending; a round
    serves ``num_iterations × steps_per_generation`` micro-steps); for an evaluation, its own
    step. ``None`` when no stored round precedes it."""
    if kind != "train":
        return optimizer_step - LOGGED_STEP_OFFSET[kind]
    i = bisect.bisect_right(train_steps, optimizer_step - LOGGED_STEP_OFFSET[kind])
    return int(train_steps[i - 1]) if i else None


def trl_metrics_row(
    entry: Mapping[str, Any],
    *,
    train_steps: Sequence[int],
    previous: int = 0,
    counts: Mapping[str, int] | None = None,
) -> dict[str, Any] | None:
    """The ``trainer_metrics`` record of one ``log_history`` entry, or ``None`` for an entry
    that is not a record (:func:`logged_kind`).

    ``previous`` is the optimizer step of the run's previous training log (TRL averages the
    loss and its own figures over the steps since); ``counts`` the ``loss_batches`` and
    ``rounds`` TRL averaged (the recorder counts them; unknown afterwards)."""
    kind = logged_kind(entry)
    if kind is None:
        return None
    t = int(entry["step"])
    averaged = t - previous if kind == "train" else 0
    prefix = "eval_" if kind == "eval" else ""
    values = {k.removeprefix(prefix): v for k, v in entry.items() if k != "step"}
    row: dict[str, Any] = {
        "optimizer_step": t,
        "kind": kind,
        "step": rollout_step(t, kind, train_steps),
        "first_step": rollout_step(t - max(averaged, 1) + 1, kind, train_steps),
        "averaged_steps": averaged,
        **(counts or {}),
    }
    for key, column in _FIGURES.items():
        row[column] = values.pop(key, None)
    row[METRICS_KEY] = {k: v for k, v in values.items() if v is None or isinstance(v, int | float)}
    return row


def trl_trainer_metrics(
    log_history: Sequence[Mapping[str, Any]], *, train_steps: Sequence[int]
) -> pa.Table:
    """The ``trainer_metrics`` records of TRL's log (``trainer.state.log_history``, or the
    ``log_history`` of a checkpoint's ``trainer_state.json``): one per training log and per
    evaluation, joined to the stored rollout steps ``train_steps`` by :func:`rollout_step`.
    What the recorder writes during training, less the counts only it sees."""
    steps = sorted(set(train_steps))
    rows, previous = [], 0
    for entry in log_history:
        row = trl_metrics_row(entry, train_steps=steps, previous=previous)
        if row is None:
            continue
        if row["kind"] == "train":
            previous = row["optimizer_step"]
        rows.append(row)
    return trainer_metrics_table(rows)


def register_trl_log(
    views: Any, log_history: Sequence[Mapping[str, Any]], *, name: str = "trl_log"
) -> pa.Table:
    """Make TRL's log queryable beside a store: registers the records of ``log_history``
    (:func:`trl_trainer_metrics`, joined to the store's train steps) as the view ``name`` on
    ``views`` (a :class:`~maxent_arrow.RunAnalytics` or the store's ``sql_views()``), where
    ``optimizer_step`` is TRL's logged ``step`` and ``(step, kind)`` joins ``steps``,
    ``groups`` and ``samples``. Returns the registered table."""
    session = getattr(views, "views", views)
    stored = session.query("SELECT DISTINCT step FROM steps WHERE kind = 'train'", trusted=True)
    table = trl_trainer_metrics(log_history, train_steps=stored.column("step").to_pylist())
    session.register(name, table)
    return table


# ---------------------------------------------------------------------------- resumes
def checkpoint_step(
    resume_from_checkpoint: str | os.PathLike[str] | bool | None,
    output_dir: str | os.PathLike[str] | None,
) -> int | None:
    """The step at which ``Trainer.train(resume_from_checkpoint=...)`` resumes, as the store
    numbers steps: the checkpoint's ``global_step`` (its ``trainer_state.json``), where TRL
    generates, and the recorder stores, the resumed run's first round. ``True`` means the
    last checkpoint in ``output_dir``; ``None`` or ``False``: no resume (``None``).

    Raises as ``Trainer.train`` would: ``ValueError`` when ``output_dir`` holds no
    checkpoint, ``FileNotFoundError`` when the checkpoint has no ``trainer_state.json``."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    path: str | os.PathLike[str] | None
    if resume_from_checkpoint is True:
        path = None if output_dir is None else get_last_checkpoint(str(output_dir))
        if path is None:  # Trainer.train's own words
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
    else:
        path = resume_from_checkpoint
    return int(TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_NAME)).global_step)


# ---------------------------------------------------------------------------- the recorder
@dataclass(frozen=True)
class Capture:
    """What ``_calculate_rewards`` saw of a round (its arguments and result, and what the
    reward functions logged for this process's rows, read before TRL gathers and clears
    it), kept until ``_generate_and_score_completions`` returns the round's tensors."""

    prompts: Sequence[Any]
    completions: Sequence[Any]
    completion_ids: Sequence[Sequence[int]]
    rewards: Any  # [B × processes, F]: every process's raw rewards, gathered
    extras: dict[str, list]  # log_extra: name -> one value per row of this process
    metrics: dict[str, list]  # log_metric: name -> values


@dataclass
class PendingStep:
    """The rounds of one step and kind not yet appended, the metrics logged in them and, for
    training rounds, the micro-batch split TRL drew for each (:mod:`.trl_split`)."""

    step: int
    rounds: list[Callable[[], pa.Table]] = field(default_factory=list)
    orders: list[np.ndarray] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    def add_metric(self, name: str, values: Sequence[Any]) -> None:
        total = self.metrics.setdefault(name, [0.0, 0])
        numbers = [float(v) for v in values]
        total[0] += math.fsum(numbers)
        total[1] += len(numbers)

    def metric_means(self) -> dict[str, tuple[float, int]]:
        return {n: (t[0] / t[1], int(t[1])) for n, t in self.metrics.items() if t[1]}


@dataclass
class RecorderState:
    """What a :class:`RolloutRecorder` keeps between rounds: one object on the trainer,
    ``rollout_state``, beside the recorder's public attributes (``rollout_store``,
    ``rollout_config``, ``rollout_columns``, ...).

    Fixed when the recorder starts: ``id_key`` (the dataset key of an example's id),
    ``record`` (the dataset columns kept), ``if_exists`` (``rollout_if_exists``) and
    ``pad_id`` (the tokenizer's, read once: a special-token property costs a lookup per
    access). Set by each attempt (:meth:`track`): ``records`` (the store keeps record tables:
    it has a commit log), ``written`` (the ``(step, kind)`` this rank stored in the effective
    history: a round of a step stored there is not stored again) and ``train_steps`` (the
    stored train steps, ascending, which TRL's logged steps join to). Per round: ``capture``
    (:class:`Capture`) and ``pending`` (:class:`PendingStep` per kind). Fixed at the run's
    first round, each said once: ``extras`` (the log_extra columns, None until then),
    ``late`` (log_extra columns left out), ``unknown`` (output keys new in TRL) and
    ``answers`` (whether the answers are JSON-able, None until the first round)."""

    id_key: str
    record: tuple[str, ...]
    if_exists: IfExists | None
    pad_id: int | None
    records: bool = False
    written: set[tuple[int, str]] = field(default_factory=set)
    train_steps: list[int] = field(default_factory=list)
    capture: Capture | None = None
    pending: dict[str, PendingStep] = field(default_factory=dict)
    extras: list[str] | None = None
    late: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    answers: bool | None = None

    def track(self, units: Sequence[Unit]) -> None:
        """What this rank stored (its units in the effective history: what a resume
        superseded is not the run's any more)."""
        self.written = {(u.step, u.kind) for u in units}
        self.train_steps = sorted({u.step for u in units if u.kind == "train"})

    def new_unknown(self, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` not said before (now said)."""
        new = sorted(set(keys) - self.unknown)
        self.unknown.update(new)
        return new

    def round_answers(self, inputs: Sequence[Mapping[str, Any]]) -> Sequence[Any] | None:
        """The rows' answers, or None: no ``answer`` key, or answers JSON cannot hold (said
        once, at the first round)."""
        if not inputs or "answer" not in inputs[0]:
            return None
        if self.answers is None:
            try:
                answer_text(inputs[0]["answer"], where="RolloutRecorder: answer")
                self.answers = True
            except SchemaError as exc:
                self.answers = False
                warnings.warn(f"{exc}; the answers are not recorded", stacklevel=3)
        return _Column(inputs, "answer") if self.answers else None

    def round_extras(self, logged: Mapping[str, list], b: int) -> dict[str, Sequence[Any]]:
        """The log_extra columns of a round: the run's, fixed at its first round (a column a
        round did not log is null there); a column first logged later is left out, and said
        once."""
        if self.extras is None:
            self.extras = sorted(logged)
        late = sorted(set(logged) - set(self.extras) - self.late)
        if late:
            self.late.update(late)
            warnings.warn(
                f"RolloutRecorder: log_extra columns {late} were first logged after the run's "
                "first round, whose columns fix the run's schema; they are not recorded",
                stacklevel=3,
            )
        return {n: logged.get(n, [None] * b) for n in self.extras}


# A mixin over TRL's trainer: checkers see the trainer's attributes and `super()` methods it
# uses; at run time its base stays `object` (the trainer comes in through the subclass's MRO).
if TYPE_CHECKING:
    _Trainer = GRPOTrainer
else:
    _Trainer = object


class RolloutRecorder(_Trainer):
    """Mixin that records every generation round of a ``trl.GRPOTrainer`` (see the module
    doc). Put it before the trainer class: ``class T(RolloutRecorder, GRPOTrainer)``.

    Parameters
    ----------
    rollout_store:
        A :class:`~maxent_arrow.store.RolloutStore`, or a path or URI where one is created
        (every process creates or opens the same store; each appends its own rank). Each
        ``train()`` writes through a store object of its own attempt
        (:meth:`begin_rollout_attempt`), kept as ``rollout_store``.
    rollout_if_exists:
        What a fresh ``train()`` (not resumed from a checkpoint) does when the store holds
        steps of an earlier run: ``"error"`` (the default, unless the given store object says
        otherwise: refused before the first step, naming the choices), ``"new_attempt"``
        (recorded in full as a new attempt that supersedes the earlier run) or ``"resume"``
        (continue after its last step). A resume from a checkpoint always resumes the store at
        the checkpoint's step.
    record_eval:
        Also record evaluation rounds (``kind="eval"``).
    background:
        Build the Arrow columns and append on a background thread
        (:class:`~maxent_arrow.integrations.appender.Appender`), in order, at most two steps
        in flight: the training step pays only for copying the round's values out of TRL's
        tensors (:func:`~.trl_tables.host_round`). An append that fails is raised by the next
        round or at the end of ``train``/``evaluate``; everything submitted is durable when
        they return.
        ``False`` appends synchronously.
    example_id:
        The dataset column whose value identifies an example (each group's ``example_id``).
        Default: the example's index in its dataset; the recorder adds it to the datasets'
        rows as ``maxent_example_index`` (reward functions see it among their keyword
        arguments).
    record_columns:
        Dataset columns to keep, each as the group column ``ds_<name>`` with the dataset's own
        Arrow type. The dataset's other columns (besides ``prompt``, ``answer`` and the id) are
        not recorded; a warning lists them once, when the recorder starts.
    *args, **kwargs:
        Those of the trainer.
    """

    def __init__(
        self,
        *args: Any,
        rollout_store: RolloutStore | str | os.PathLike[str],
        rollout_if_exists: IfExists | None = None,
        record_eval: bool = True,
        background: bool = True,
        example_id: str | None = None,
        record_columns: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        if example_id is None:  # the index travels with each row
            args, kwargs = _indexed_datasets(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)
        if isinstance(record_columns, str):
            raise SchemaError("RolloutRecorder: record_columns: expected a list of names")
        record = tuple(record_columns)
        dataset, record_types = self._dataset_context(example_id, record)
        config = trl_run_config(self)
        self.rollout_config = config.replace(extra={**config.extra, "dataset": dataset})
        if rollout_if_exists is not None and rollout_if_exists not in IF_EXISTS:
            raise ArgumentError(
                f"RolloutRecorder: rollout_if_exists: expected one of {IF_EXISTS}, got "
                f"{rollout_if_exists!r}"
            )
        if isinstance(rollout_store, RolloutStore):
            self.rollout_store = rollout_store
        else:
            self.rollout_store = RolloutStore.create(
                rollout_store,
                config=self.rollout_config.to_dict(),
                if_exists=rollout_if_exists or "error",
            )
        self.record_eval = record_eval
        self.rollout_appender = Appender(background=background)
        self.rollout_state = RecorderState(
            id_key=example_id or INDEX_KEY,
            record=record,
            if_exists=rollout_if_exists,
            pad_id=cast(int | None, self._tokenizer.pad_token_id),
        )
        # The attempt this trainer writes as (begun by train(), or an evaluation outside it).
        self.rollout_attempt: str | None = None
        units = self.rollout_store.units(ranks=[self.accelerator.process_index])
        self.rollout_state.track(units)
        # The run's user columns: those its stored files have (a resumed run), then the
        # dataset columns asked for, with the dataset's types; its log_extra columns are
        # fixed already then.
        stored = self.rollout_store.schema() if units else pa.schema([])
        self.rollout_columns = UserColumns.of_schema(stored)
        for name, kind in record_types.items():
            self.rollout_columns.declare(DATASET + name, kind)
        if units:
            extras = [n.removeprefix(EXTRA) for n in stored.names if n.startswith(EXTRA)]
            self.rollout_state.extras = extras
        # The records of this trainer's logs (docs/arrow-layout.md, "Trainer metrics").
        self.rollout_metrics: list[dict[str, Any]] = []

    def _dataset_context(
        self, example_id: str | None, record: tuple[str, ...]
    ) -> tuple[dict[str, Any], dict[str, pa.DataType]]:
        """What of the dataset rows is recorded (the run config's ``extra["dataset"]``) and
        the Arrow types of the columns to keep, checked against the dataset's columns; the one
        warning about the rest."""
        types = dataset_types(self.train_dataset) or {}
        names = [n for n in types if n != INDEX_KEY]
        asked = [*record, *([example_id] if example_id else [])]
        missing = [n for n in asked if types and n not in types]
        if missing:
            raise SchemaError(
                f"RolloutRecorder: record_columns/example_id: the dataset has no column "
                f"{missing}; its columns are {names}"
            )
        kept = {"prompt", "answer", *asked}
        left_out = [n for n in names if n not in kept]
        if self.args.remove_unused_columns:
            warnings.warn(
                "RolloutRecorder: remove_unused_columns=True: TRL drops every dataset column "
                "but the prompt, so example_id, answer and record_columns are not recorded",
                stacklevel=3,
            )
        elif left_out:
            warnings.warn(
                f"RolloutRecorder: dataset columns not recorded: {left_out} "
                "(record_columns=[...] keeps them as ds_<name> columns)",
                stacklevel=3,
            )
        answer = types.get("answer")
        record_types = {n: types[n] for n in record if n in types}
        info = {
            "example_id": example_id or "index",
            "columns": {n: str(kind) for n, kind in record_types.items()},
            "answer": None if answer is None else ("text" if answer == pa.string() else "json"),
            "not_recorded": left_out,
        }
        return info, record_types

    # -- TRL's private methods, extended (trl_contract declares them; its tests pin them)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # What the reward functions logged (log_extra / log_metric) for this process's rows,
        # before _generate_and_score_completions gathers and clears it.
        self.rollout_state.capture = Capture(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids_list,
            rewards=rewards,
            extras={k: list(v) for k, v in self._pending_extra_logs.items()},
            metrics={k: list(v) for k, v in self._pending_metrics.items()},
        )
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.record_round(inputs, output)
        return output

    # -- the Trainer's public hook for what it logs
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        assert self.model is not None  # set by the trainer
        mode = "train" if self.model.training else "eval"
        # What TRL is about to average (it clears these in its log).
        counts = {n: len(self._metrics[mode].get(key, ())) for n, key in METRIC_COUNTS.items()}
        super().log(logs, start_time)
        *earlier, entry = self.state.log_history
        previous = next((int(e["step"]) for e in reversed(earlier) if logged_kind(e) == "train"), 0)
        self.record_log(entry, counts, previous=previous)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, as an attempt of the run in the store, begun before the first
        step (:meth:`begin_rollout_attempt`): a resume from a checkpoint resumes the store at
        the checkpoint's ``global_step``."""
        step = checkpoint_step(resume_from_checkpoint, self.args.output_dir)
        self.begin_rollout_attempt(resume_from=step)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.flush_rollouts()
            self.rollout_appender.wait()
            if self.rollout_state.records and self.accelerator.is_main_process:
                # The log checkpoint plain readers read (docs/commit-protocol.md); a failure
                # costs them freshness, never data.
                with contextlib.suppress(OSError, StoreError):
                    self.rollout_store.checkpoint()

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        if self.rollout_attempt is None:  # an evaluation before any train(): its own attempt
            self.begin_rollout_attempt()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.flush_rollouts("eval")
            self.rollout_appender.wait()

    # -- the attempt
    def begin_rollout_attempt(self, *, resume_from: int | None = None) -> str | None:
        """Begin this trainer's next attempt in the store (``train()`` calls it first): a
        resume at step ``resume_from`` (a checkpoint's ``global_step``: the stored steps from
        there on, of earlier attempts, are superseded), or a fresh run, which a store that
        holds an earlier run's steps refuses unless ``rollout_if_exists`` (or the given store
        object) says ``"new_attempt"`` or ``"resume"``. Each call is an attempt of its own
        (:meth:`~maxent_arrow.store.RolloutStore.next_attempt`), whose store object becomes
        ``rollout_store``. A refusal raises :class:`~maxent_arrow.errors.StoreError` before
        anything is written, and the trainer keeps the store object it had. Returns the
        attempt id (``None``: a store without a commit log, which keeps no attempts)."""
        store = self.rollout_store
        # HF's Trainer evaluates at a step before it saves that step's checkpoint, and the
        # resumed run does not evaluate there again: evaluations resume a step later.
        opened = store.next_attempt(
            resume_from=resume_from,
            if_exists=self.rollout_state.if_exists,
            resume_kinds=None if resume_from is None else {"eval": resume_from + 1},
        )
        try:
            begun = opened.begin_attempt(config=self.rollout_config.to_dict())
        except StoreError as exc:
            if resume_from is not None or not store.units():
                raise
            raise StoreError(
                f"{exc}. With TRL: train(resume_from_checkpoint=True) (or a checkpoint's path) "
                "resumes the run from its last checkpoint; a new output_dir and rollout_store "
                "start a new run; rollout_if_exists='new_attempt' records this run over the "
                "earlier one"
            ) from exc
        self.rollout_store = opened
        self.rollout_attempt = begun or opened.attempt_spec.id
        self.rollout_state.records = begun is not None
        # The effective history now: what a resume superseded is not this run's any more.
        self.rollout_state.track(opened.units(ranks=[self.accelerator.process_index]))
        return begun

    # -- recording
    def record_round(self, inputs: Sequence[Mapping[str, Any]], output: Mapping[str, Any]) -> None:
        """Build this process's group rows of the round TRL just generated and scored."""
        state = self.rollout_state
        capture, state.capture = state.capture, None
        assert self.model is not None  # set by the trainer
        kind = "train" if self.model.training else "eval"
        if kind == "eval" and not self.record_eval:
            return
        if capture is None:
            raise LayoutError(
                "RolloutRecorder: _generate_and_score_completions returned without calling "
                f"_calculate_rewards; TRL's flow changed (this recorder is written for "
                f"{TRL_VERSION})"
            )
        tensors = TrlOutput.read(output, where="trl_group_table: outputs")
        unknown = state.new_unknown(tensors.unknown)
        if unknown:
            warnings.warn(
                f"RolloutRecorder: TRL returned keys it did not in {TRL_VERSION}, not "
                f"recorded: {unknown}",
                stacklevel=2,
            )
        b = len(capture.prompts)
        context = self._round_context(kind)
        pending = state.pending[kind]
        lengths = None
        if self.mask_truncated_completions:  # the mask zeroes truncated rows: use the ids
            lengths = np.fromiter(map(len, capture.completion_ids), dtype=np.int64, count=b)
        # On the loop: copy what is needed out of TRL's tensors (TRL moves on after this).
        host = host_round(
            tensors,
            context,
            rows=b,
            first_index=context.rank * b,
            rewards=capture.rewards[context.rank * b : (context.rank + 1) * b],
            completion_lengths=lengths,
        )
        for name, values in capture.metrics.items():
            pending.add_metric(name, values)
        # Later, with the append (on the background thread): the Arrow columns. TRL does not
        # touch the prompt and completion lists, the logged values or the dataset rows after
        # this call.
        values = RoundValues(
            prompts=capture.prompts,
            completions=capture.completions,
            answers=state.round_answers(inputs),
            example_ids=_Column(inputs, state.id_key),
            dataset_columns={n: _Column(inputs, n) for n in state.record},
            extras=state.round_extras(capture.extras, b),
        )
        pending.rounds.append(functools.partial(round_table, host, values, context))
        if kind == "train":  # the split TRL's _prepare_inputs is about to draw (trl_split)
            pending.orders.append(next_shuffle(b).numpy())
        # A GRPOConfig, whose __post_init__ sets steps_per_generation (TRL declares the
        # TrainingArguments base, and the field Optional).
        args: Any = self.args
        generate_every = args.steps_per_generation * self.num_iterations
        if kind == "train" and generate_every >= self.args.gradient_accumulation_steps:
            # Rounds are at least an optimizer step apart: none can share this step.
            self.flush_rollouts(kind)

    def _round_context(self, kind: str) -> RoundContext:
        """The context of a round of ``kind`` generated now, with its step's pending rounds
        ready for it: those of an earlier step are flushed first."""
        state = self.rollout_state
        step = int(self.state.global_step)
        pending = state.pending.get(kind)
        if pending is not None and pending.step != step:
            self.flush_rollouts(kind)
            pending = None
        if pending is None:
            pending = state.pending[kind] = PendingStep(step)
            if kind == "train" and step not in state.train_steps:
                bisect.insort(state.train_steps, step)
        group_size = self.num_generations if kind == "train" else self.num_generations_eval
        assert group_size is not None  # GRPOTrainer sets both
        return RoundContext(
            step=step,
            rank=self.accelerator.process_index,
            kind=kind,
            group_size=group_size,
            reward_names=self.rollout_config.reward_names,
            reward_weights=self.rollout_config.reward_weights,
            round_index=len(pending.rounds),
            eos_token_ids=self.eos_token_ids,
            pad_token_id=state.pad_id,
            user_columns=self.rollout_columns,
            offpolicy=trl_offpolicy(self, step=step),
        )

    def record_log(
        self, entry: Mapping[str, Any], counts: Mapping[str, int], *, previous: int = 0
    ) -> None:
        """Record one entry of TRL's log (:func:`trl_metrics_row`; ``previous``: the step of
        the run's previous training log) in ``rollout_metrics`` and, from the main process,
        in the store's ``trainer_metrics`` records."""
        state = self.rollout_state
        row = trl_metrics_row(
            entry, train_steps=state.train_steps, previous=previous, counts=counts
        )
        if row is None:
            return
        self.rollout_metrics.append(row)
        if state.records and self.accelerator.is_main_process:
            table = trainer_metrics_table([row])
            append = self.rollout_store.append_records
            self.rollout_appender.submit(functools.partial(append, R.TRAINER_METRICS, table))

    def trainer_metrics(self) -> pa.Table:
        """The ``trainer_metrics`` records of this trainer's logs so far."""
        return trainer_metrics_table(self.rollout_metrics)

    def flush_rollouts(self, kind: str | None = None) -> None:
        """Submit the pending rounds (of ``kind``, or all) as one append per kind (see
        ``background``; :meth:`Appender.wait` on ``rollout_appender`` makes them durable)."""
        state = self.rollout_state
        for name in [kind] if kind is not None else list(state.pending):
            pending = state.pending.pop(name, None)
            if pending is None:
                continue
            if (pending.step, name) in state.written:
                warnings.warn(
                    f"RolloutRecorder: a {name} round at step {pending.step} of rank "
                    f"{self.accelerator.process_index} is already stored (a second evaluation "
                    "at one step, or a run continued at a step the store holds); this one is "
                    "not recorded",
                    stacklevel=2,
                )
                continue
            state.written.add((pending.step, name))
            rank = self.accelerator.process_index
            # The rounds' split, in a store that keeps record tables (one with a commit log).
            record = state.records and bool(pending.orders)
            self.rollout_appender.submit(
                _append_job(
                    self.rollout_store,
                    pending,
                    self.rollout_columns,
                    splits=split_rows(pending.step, rank, pending.orders) if record else None,
                    rank=rank,
                    kind=name,
                    config=self.rollout_config,
                    max_completion_len=self.max_completion_length,
                )
            )


def _indexed_datasets(init: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The trainer's arguments with ``train_dataset`` and ``eval_dataset`` carrying each row's
    index (:func:`~.context.with_index`)."""
    bound = inspect.signature(init).bind_partial(*args, **kwargs)
    for name in ("train_dataset", "eval_dataset"):
        if bound.arguments.get(name) is not None:
            bound.arguments[name] = with_index(bound.arguments[name])
    return bound.args, bound.kwargs


def _append_job(
    store: RolloutStore,
    pending: PendingStep,
    user_columns: UserColumns,
    *,
    splits: pa.Table | None = None,
    **where: Any,
) -> Callable[[], None]:
    """The append of one step: its rounds' group rows built and joined, every user column of
    the run, the step row, the batch's layout check and the durable write, then the rounds'
    recorded split (``splits``, :mod:`.trl_split`; run by the Appender, on its thread)."""
    rounds, step = list(pending.rounds), pending.step
    metrics = pending.metric_means()

    def job() -> None:
        tables = [build() for build in rounds]
        groups = tables[0] if len(tables) == 1 else concat_rounds(tables)
        groups = declare_families(user_columns.complete(groups), (CORE, TRL))
        row = step_row(groups, step=step, policy_version=step, metrics=metrics, **where)
        store.append(RolloutBatch(groups, row))
        if splits is not None:
            store.append_records(SPLIT_TABLE, splits)

    return job


class _Column(Sequence):
    """One key of the dataset rows, read by index (only the rows that are looked at)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], key: str) -> None:
        self.rows, self.key = rows, key

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        return self.rows[i].get(self.key)


class RecordingGRPOTrainer(RolloutRecorder, GRPOTrainer):
    """``trl.GRPOTrainer`` that records every generation round into a rollout store: the
    trainer's arguments plus ``rollout_store=`` and ``record_eval=``
    (:class:`RolloutRecorder`)."""
