"""The store-fed trainer against TRL, option by option (issue 38, item 1).

Each cell trains the tiny model twice from the same weights and settings: TRL's
``GRPOTrainer`` generating its own rounds (with the recorder), then
:class:`~maxent_arrow.integrations.trl_replay.StoreFedGRPOTrainer` fed the recorded store in
order. The loss of every micro-batch, the logged losses and gradient norms, and the gradient
of every optimizer step (all parameters, at the optimizer step) agree to 1e-6; each option
at gradient accumulation 1 and 2. Two optimizer steps per cell, ``num_iterations=2`` unless the
cell sets it (so the second step trains on a ratio other than 1, against the stored
behaviour log-probs), dropout off (a loss is then a function of weights and batch alone).

The values of ``loss_type``, ``importance_sampling_level``, ``scale_rewards``,
``multi_objective_aggregation`` and ``vllm_importance_sampling_mode`` are read from TRL's
source when the tests are collected (every string ``GRPOTrainer`` compares the option with),
so a value TRL adds gets a cell, which fails until the store-fed trainer handles it
(``trl_contract.FED_OPTION_VALUES``). Cells whose settings coincide run once.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's warning, by TRL's switch

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

pytest.importorskip("trl")

import trl_runs  # noqa: E402
from transformers import ByT5Tokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402  # pyright: ignore[reportPrivateImportUsage]
from trl.trainer.utils import shuffle_sequence_dict  # noqa: E402

from maxent_arrow import RolloutBatch, RolloutStore  # noqa: E402
from maxent_arrow.errors import ArgumentError, StoreError  # noqa: E402
from maxent_arrow.integrations import (  # noqa: E402
    RecordingGRPOTrainer,
    RoundContext,
    RoundValues,
    StoreFedGRPOTrainer,
    trl_group_table,
    trl_inputs,
)
from maxent_arrow.integrations.steps import step_row  # noqa: E402
from maxent_arrow.integrations.trl_contract import (  # noqa: E402
    FED_OPTION_VALUES,
    next_shuffle,
)
from maxent_arrow.integrations.trl_split import SPLIT_TABLE, recorded_splits  # noqa: E402
from maxent_arrow.rollout import RunConfig  # noqa: E402
from maxent_arrow.store import ReadOnlyStore, ReplaySampler, SamplerOptions  # noqa: E402

TOLERANCE = 1e-6
STEPS = 2
# Every cell's settings, unless it sets them: two optimizer steps, the second trained on a
# ratio other than 1 (num_iterations=2: against the stored behaviour log-probs), two groups per
# micro-batch, β = 0, dropout off, TRL's completions log off.
BASE: dict[str, Any] = dict(
    beta=0.0,
    num_iterations=2,
    max_steps=STEPS,
    per_device_train_batch_size=8,
    log_completions=False,
    disable_dropout=True,
)


# ---------------------------------------------------------------------------- TRL's values
def trl_values(option: str) -> list[str]:
    """Every string ``GRPOTrainer``'s source compares ``self.<option>`` or
    ``args.<option>`` with (``==``, ``!=``, ``in [...]``): the values TRL's code has a branch
    for, read from the installed TRL."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer)))
    found: set[str] = set()
    for node in ast.walk(tree):
        left = getattr(node, "left", None)
        if not (
            isinstance(node, ast.Compare)
            and isinstance(left, ast.Attribute)
            and left.attr == option
            and isinstance(left.value, ast.Name)
            and left.value.id in {"self", "args"}
        ):
            continue
        for c in node.comparators:
            items = c.elts if isinstance(c, ast.List | ast.Tuple | ast.Set) else [c]
            found |= {
                i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)
            }
    default = GRPOConfig.__dataclass_fields__[option].default
    assert default in found, (option, default, found)  # the reading found TRL's branches
    return sorted(found)


LOSS_TYPES = trl_values("loss_type")
IS_LEVELS = trl_values("importance_sampling_level")
SCALE_REWARDS = trl_values("scale_rewards")
AGGREGATIONS = trl_values("multi_objective_aggregation")
VLLM_IS_MODES = trl_values("vllm_importance_sampling_mode")


def test_the_values_are_read_from_trl_and_each_is_one_the_fed_trainer_handles():
    """Also the gate of the matrix: a value TRL has that the fed trainer does not declare
    fails here (and its cell fails, refused by the trainer)."""
    assert {"grpo", "bnpo", "dapo"} <= set(LOSS_TYPES) and IS_LEVELS == ["sequence", "token"]
    for option, values in {
        "loss_type": LOSS_TYPES,
        "importance_sampling_level": IS_LEVELS,
        "scale_rewards": SCALE_REWARDS,
        "multi_objective_aggregation": AGGREGATIONS,
        "vllm_importance_sampling_mode": VLLM_IS_MODES,
    }.items():
        assert sorted(set(values) - FED_OPTION_VALUES[option]) == [], option


# ---------------------------------------------------------------------------- the cells
@dataclass(frozen=True)
class Cell:
    """A cell's ``GRPOConfig`` settings over the base ones, and whether TRL generates with the
    multi-turn ``rollout_func`` (:func:`tool_rollout`)."""

    options: tuple[tuple[str, Any], ...]
    rollout: bool = False

    @classmethod
    def of(cls, rollout: bool = False, **options: Any) -> Cell:
        return cls(tuple(sorted(options.items())), rollout)

    def settings(self, ga: int) -> dict[str, Any]:
        """The cell's ``GRPOConfig`` settings over the tests' (:func:`trl_runs.grpo_config`)."""
        return {**BASE, "gradient_accumulation_steps": ga, **dict(self.options)}

    def key(self, ga: int) -> tuple:
        """What decides the runs: the settings, less those that are TRL's defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        settings = {k: v for k, v in self.settings(ga).items() if v != defaults.get(k)}
        if settings.get("steps_per_generation") == ga:  # TRL's default: gradient accumulation
            del settings["steps_per_generation"]
        return self.rollout, tuple(sorted(settings.items()))


def _level(loss_type: str) -> str:
    return "sequence" if loss_type == "luspo" else "token"  # what TRL asks of luspo


CELLS: dict[str, Cell] = {
    **{
        f"loss_type={v}": Cell.of(loss_type=v, importance_sampling_level=_level(v))
        for v in LOSS_TYPES
    },
    **{
        f"importance_sampling_level={v}": Cell.of(loss_type="grpo", importance_sampling_level=v)
        for v in IS_LEVELS
    },
    **{f"scale_rewards={v}": Cell.of(scale_rewards=v) for v in SCALE_REWARDS},
    **{
        f"multi_objective_aggregation={v}": Cell.of(multi_objective_aggregation=v)
        for v in AGGREGATIONS
    },
    "beta": Cell.of(beta=0.04),
    # Small enough that the second step's ratios are clipped (checked).
    "epsilon/epsilon_high/delta": Cell.of(
        loss_type="bnpo", epsilon=0.002, epsilon_high=0.004, delta=1.003
    ),
    "num_iterations=1": Cell.of(num_iterations=1),
    # At GA=2, two rounds per optimizer step (checked).
    "steps_per_generation=1": Cell.of(steps_per_generation=1, num_iterations=1),
    "steps_per_generation=4": Cell.of(steps_per_generation=4, loss_type="bnpo"),
    "mask_truncated_completions": Cell.of(mask_truncated_completions=True),
    # Multi-turn: a tool's reply inside each completion (tool_mask 0), the generator's own
    # log-probs at its temperature, and TRL's off-policy sequence mask, which reads them.
    "tool_mask": Cell.of(rollout=True, off_policy_mask_threshold=0.0),
}
# The cells cheap enough for `make test-fast` (the rest are slow, run by `make test`).
FAST = {
    ("loss_type=bnpo", 2),
    ("mask_truncated_completions", 1),
    ("tool_mask", 2),
    ("steps_per_generation=1", 2),
}
MATRIX = [
    pytest.param(
        name, ga, id=f"{name}-GA{ga}", marks=() if (name, ga) in FAST else pytest.mark.slow
    )
    for name in CELLS
    for ga in (1, 2)
]


# ---------------------------------------------------------------------------- the runs
# A tool's reply the model did not write (the bytes "=7\n" in ByT5's ids).
TOOL_REPLY = [64, 58, 13]
ROLLOUT_TEMPERATURE = 0.7


def _sample(model: Any, ids: list[int], n: int) -> list[int]:
    prompt = torch.tensor([ids])
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=True,
        temperature=ROLLOUT_TEMPERATURE,
        top_k=0,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def tool_rollout(prompts: list[Any], trainer: Any) -> dict[str, list]:
    """A multi-turn rollout (TRL's ``rollout_func``): two tokens of the model, a tool's reply,
    two more of the model, EOS; ``env_mask`` (TRL's ``tool_mask``) 0 on the reply, and the
    generator's log-probs of every token at its sampling temperature (what an inference
    engine reports: not the trainer's)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    tok = trainer.processing_class
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            first = _sample(model, ids, 2)
            second = _sample(model, ids + first + TOOL_REPLY, 2)
            completion = [*first, *TOOL_REPLY, *second, 1]
            logits = model(torch.tensor([ids + completion])).logits[0, len(ids) - 1 : -1]
            logps = torch.log_softmax(logits / ROLLOUT_TEMPERATURE, dim=-1)
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(
                logps.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
            )
            out["env_mask"].append([1, 1, 0, 0, 0, 1, 1, 1])
    return out


class _Gradients(TrainerCallback):
    """The gradient of every optimizer step, all parameters flattened (after clipping)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        assert model is not None
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten()
            for p in model.parameters()
        ]
        self.steps.append(torch.cat(grads).clone())


class _Kept:
    """Keeps the loss of each training micro-batch (``_compute_loss``)."""

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        loss = super()._compute_loss(model, inputs)  # type: ignore[misc]
        if model.training:
            self.__dict__.setdefault("kept", []).append(float(loss.detach()))
        return loss


class TrlCell(_Kept, RecordingGRPOTrainer):
    pass


class FedCell(_Kept, StoreFedGRPOTrainer):
    pass


@dataclass
class Trained:
    losses: list[float]  # per training micro-batch
    gradients: list[torch.Tensor]  # per optimizer step
    logs: list[dict[str, Any]]  # TRL's training log entries
    store: Path

    def logged(self, key: str) -> list[float]:
        return [e[key] for e in self.logs]


def _config(out: Path, ga: int, cell: Cell, **overrides: Any) -> GRPOConfig:
    return trl_runs.grpo_config(out, **{**cell.settings(ga), **overrides})


def _trained(trainer: Any, gradients: _Gradients, store: Path) -> Trained:
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return Trained(list(trainer.__dict__.get("kept", [])), gradients.steps, logs, store)


def train_trl(model: Path, root: Path, ga: int, cell: Cell, **overrides: Any) -> Trained:
    """TRL's own run of the cell, recorded into ``root / "store"``."""
    gradients = _Gradients()
    trainer = TrlCell(
        model=str(model),
        reward_funcs=[trl_runs.correct, trl_runs.length],
        args=_config(root / "trl", ga, cell, **overrides),
        train_dataset=trl_runs.dataset(8),
        processing_class=ByT5Tokenizer(),
        callbacks=[gradients],
        rollout_func=tool_rollout if cell.rollout else None,
        rollout_store=root / "store",
        background=False,
    )
    return _trained(trainer, gradients, root / "store")


def train_fed(
    model: Path, store: Path, out: Path, ga: int, cell: Cell, **overrides: Any
) -> Trained:
    """The store-fed run of the cell: the same weights and settings, fed ``store`` in order."""
    gradients = _Gradients()
    trainer = FedCell(
        model=str(model),
        reward_funcs=[trl_runs.correct, trl_runs.length],
        args=_config(out, ga, cell, **overrides),
        train_dataset=trl_runs.dataset(8),
        processing_class=ByT5Tokenizer(),
        callbacks=[gradients],
        replay_store=ReadOnlyStore(store),
    )
    return _trained(trainer, gradients, store)


def assert_trained_alike(fed: Trained, trl: Trained) -> None:
    assert len(trl.gradients) == len(fed.gradients) == STEPS
    assert len(fed.losses) == len(trl.losses) >= STEPS
    np.testing.assert_allclose(fed.losses, trl.losses, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(fed.logged("loss"), trl.logged("loss"), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(
        fed.logged("grad_norm"), trl.logged("grad_norm"), rtol=0, atol=TOLERANCE
    )
    for step, (got, want) in enumerate(zip(fed.gradients, trl.gradients, strict=True)):
        assert float((got - want).abs().max()) <= TOLERANCE, step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cells' runs, each distinct setting once: ``runs(ga, cell) -> (trl, fed)``."""
    base = tmp_path_factory.mktemp("fed-matrix")
    model = trl_runs.model_dir(base)
    done: dict[tuple, tuple[Trained, Trained]] = {}

    def run(ga: int, cell: Cell) -> tuple[Trained, Trained]:
        key = cell.key(ga)
        if key not in done:
            root = tmp_path_factory.mktemp("cell")  # a fresh one, also after a failed run
            trl = train_trl(model, root, ga, cell)
            done[key] = trl, train_fed(model, trl.store, root / "fed", ga, cell)
        return done[key]

    run.model = model  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize(("name", "ga"), MATRIX)
def test_the_store_fed_trainer_trains_as_trl_did(runs, name, ga):
    cell = CELLS[name]
    trl, fed = runs(ga, cell)
    assert_trained_alike(fed, trl)
    # Each cell exercises its option.
    groups = ReadOnlyStore(trl.store).read(kind="train")
    if name == "mask_truncated_completions":
        info = pc.list_flatten(groups.column("completion_info"))
        truncated = pc.struct_field(info, "truncated").to_pylist()
        assert 0 < sum(truncated) < len(truncated)
    if name == "tool_mask":
        masks = [m for g in groups.column("tool_mask").to_pylist() for m in g]
        assert masks and all(m == [1, 1, 0, 0, 0, 1, 1, 1] for m in masks)
        assert groups.column("sampling_token_logp").null_count == 0
    if name == "beta":
        assert groups.column("ref_token_logp").null_count == 0
    if name == "epsilon/epsilon_high/delta":
        assert trl.logged("clip_ratio/region_mean")[-1] > 0
    settings = cell.settings(ga)
    generate_every = settings.get("steps_per_generation", ga) * settings["num_iterations"]
    old = groups.column("behavior_token_logp").null_count == 0  # stored (and fed back)
    assert old == (ga % generate_every != 0)  # where TRL computes them
    if name == "steps_per_generation=1" and ga == 2:  # two rounds per optimizer step
        assert set(groups.column("round").to_pylist()) == {0, 1}


@pytest.mark.parametrize("mode", VLLM_IS_MODES)
def test_each_vllm_importance_sampling_mode_is_handled(mode):
    """TRL applies these only when it generates with vLLM (not installed here: a trainer
    with ``use_vllm=True`` cannot be built). The recorded ratio of each mode goes back to
    TRL as TRL gave it: test_a_stored_vllm_ratio_goes_back_as_trl_gave_it."""
    assert mode in FED_OPTION_VALUES["vllm_importance_sampling_mode"]
    pytest.importorskip("vllm", reason="TRL's vLLM generation needs vLLM")


# ---------------------------------------------------------------------------- the split
def test_next_shuffle_is_the_draw_of_trls_shuffle_and_leaves_the_generator_as_it_was():
    torch.manual_seed(7)
    ahead = next_shuffle(9)
    assert torch.equal(next_shuffle(9), ahead)  # the generator put back
    batch: Any = {"x": torch.arange(9), "n": torch.tensor(3), "y": list("abcdefghi")}
    shuffled: Any = shuffle_sequence_dict(batch)
    assert torch.equal(shuffled["x"], ahead) and int(shuffled["n"]) == 3
    assert shuffled["y"] == [list("abcdefghi")[i] for i in ahead.tolist()]
    assert not torch.equal(ahead, torch.arange(9))


@pytest.mark.slow
def test_the_recorded_split_is_the_one_trl_trained_on(tmp_path):
    """The recorded permutation of each round, applied to the round's stored rows, gives the
    micro-batches TRL trained on, in TRL's order (gradient accumulation 2, two rounds)."""
    probe = trl_runs.trainer(
        tmp_path,
        background=False,
        num_iterations=1,
        max_steps=2,
        beta=0.0,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        log_completions=False,
    )
    probe.train()
    store = ReadOnlyStore(tmp_path / "store")
    splits = recorded_splits(store)
    assert sorted(splits) == [(0, 0, "train", 0), (1, 0, "train", 0)]
    trained = [completion for _, _, completion in probe.trained]
    expected = []
    for step in (0, 1):
        groups = store.read(steps=[step], kind="train")
        rows = [tuple(c) for g in groups.column("completion_ids").to_pylist() for c in g]
        order = splits[(step, 0, "train", 0)]
        assert sorted(order.tolist()) == list(range(8)) and order.tolist() != list(range(8))
        expected += [rows[i] for i in order]
    assert trained == expected
    table = store.read_records(SPLIT_TABLE)
    assert table.column("order").type.value_type.bit_width == 32


def test_a_batch_that_is_not_a_recorded_round_whole_is_split_by_trl_with_a_warning(runs, tmp_path):
    """A fed generation batch of half a stored round (8 of its 16 rows) has no recorded split
    to replay: TRL's shuffle draws its own, and the trainer says once that the losses that
    depend on it differ from TRL's."""
    trl, _ = runs(2, CELLS["loss_type=bnpo"])
    fed = FedCell(
        model=str(runs.model),
        reward_funcs=[trl_runs.correct, trl_runs.length],
        args=_config(tmp_path / "fed", 2, CELLS["loss_type=bnpo"], per_device_train_batch_size=4),
        train_dataset=trl_runs.dataset(8),
        processing_class=ByT5Tokenizer(),
        replay_store=ReadOnlyStore(trl.store),
    )
    assert sorted(fed.replay_splits) == [(0, 0, "train", 0)]
    with pytest.warns(UserWarning, match=r"no recorded micro-batch split for the 8 rows of step 0"):
        fed.train()
    assert fed.split_warned


# ---------------------------------------------------------------------------- what TRL computes
@pytest.mark.slow
@pytest.mark.parametrize(
    ("fed_cell", "store_cell", "column"),
    [
        ("beta", "loss_type=dapo", "ref_token_logp"),  # β > 0 fed a store of β = 0
        ("loss_type=dapo", "num_iterations=1", "behavior_token_logp"),  # two iterations, of one
    ],
)
def test_log_probs_trl_computes_and_the_store_lacks_are_computed_as_trl_does(
    runs, tmp_path, fed_cell, store_cell, column
):
    """A store recorded without what the fed trainer's settings make TRL compute at
    generation (the reference log-probs with β > 0; the old policy's where a round serves
    several steps) but of the same rollouts (the first round is generated before any update):
    the fed trainer computes them as TRL does, and trains as TRL's run of its settings did."""
    trl, _ = runs(1, CELLS[fed_cell])
    source, _ = runs(1, CELLS[store_cell])
    stored = ReadOnlyStore(source.store).read(steps=[0], kind="train")
    rollouts = ReadOnlyStore(trl.store).read(steps=[0], kind="train")
    assert stored.column("completion_ids").equals(rollouts.column("completion_ids"))
    assert stored.column(column).null_count == stored.num_rows
    assert rollouts.column(column).null_count == 0
    fed = train_fed(runs.model, source.store, tmp_path / "fed", 1, CELLS[fed_cell])
    assert_trained_alike(fed, trl)


def test_an_option_value_the_fed_trainer_does_not_reproduce_is_refused(runs, tmp_path):
    trl, _ = runs(2, CELLS["loss_type=bnpo"])
    config = _config(tmp_path / "fed", 1, Cell.of())
    config.loss_type = "new_loss"  # a value TRL could add
    with pytest.raises(
        ArgumentError, match=r"loss_type='new_loss' is not a value .*\['bnpo', 'cispo'"
    ):
        StoreFedGRPOTrainer(
            model=str(runs.model),
            reward_funcs=[trl_runs.correct],
            args=config,
            train_dataset=trl_runs.dataset(8),
            processing_class=ByT5Tokenizer(),
            replay_store=ReadOnlyStore(trl.store),
        )


# ---------------------------------------------------------------------------- vLLM's ratio
def _vllm_round(tmp_path: Path, ratio: torch.Tensor, settings: dict[str, Any]) -> ReplaySampler:
    """A store of one TRL round whose output has vLLM's ``importance_sampling_ratio``."""
    b, width, lengths = 4, 5, [5, 2, 3, 1]
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.arange(10, 10 + n), 1
    outputs = {
        "prompt_ids": torch.tensor([[5, 6]] * b),
        "prompt_mask": torch.ones(b, 2, dtype=torch.int64),
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": torch.linspace(-1, 1, b),
        "num_items_in_batch": mask.sum(),
        "importance_sampling_ratio": ratio,
    }
    context = RoundContext(
        step=0, rank=0, kind="train", group_size=4, reward_names=["r"], reward_weights=[1.0]
    )
    values = RoundValues(prompts=["p"] * b, completions=["c"] * b)
    table = trl_group_table(outputs, context, values, first_index=0, rewards=torch.zeros(b, 1))
    config = RunConfig(reward_names=("r",), extra={"trl": settings})
    store = RolloutStore.create(tmp_path / "store")
    store.append(RolloutBatch(table, step_row(table, step=0, rank=0, kind="train", config=config)))
    return ReplaySampler(store, SamplerOptions(sampling="sequential", record=False))


@pytest.mark.parametrize("mode", VLLM_IS_MODES)
def test_a_stored_vllm_ratio_goes_back_as_trl_gave_it(tmp_path, mode):
    """Per token (``[B, C]``, 1 on padding: TRL's exp of a masked difference) or per sequence
    (``[B, 1]``), the stored ratio is the ``importance_sampling_ratio`` TRL's loss gets, for
    a trainer of the recorded settings; other settings are refused, naming them."""
    settings = {
        "vllm_importance_sampling_mode": mode,
        "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 3.0,
    }
    torch.manual_seed(0)
    if mode.startswith("token"):
        keep = torch.arange(5)[None, :] < torch.tensor([5, 2, 3, 1])[:, None]
        ratio = torch.where(keep, torch.rand(4, 5) + 0.5, torch.ones(4, 5))
    else:
        ratio = torch.rand(4, 1) + 0.5
    sampled = _vllm_round(tmp_path, ratio, settings).sample(current_version=0)
    assert sampled is not None
    assert recorded_splits(ReadOnlyStore(tmp_path / "store")) == {}  # recorded by no trainer
    got = trl_inputs(sampled, pad_token_id=0, importance_sampling=settings)
    assert torch.equal(got["importance_sampling_ratio"], ratio)
    assert "importance_sampling_ratio" not in trl_inputs(sampled, pad_token_id=0)
    other = {**settings, "vllm_importance_sampling_clip_max": 2.0}
    with pytest.raises(
        StoreError, match=r"recorded under other settings .*clip_max.*\(3\.0, 2\.0\)"
    ):
        trl_inputs(sampled, pad_token_id=0, importance_sampling=other)
