"""Parity with the seed's ``maxent_grpo.training.types.rewards``: names, fields, order, defaults,
annotations and properties, transcribed from the seed's API text
(``reference/seed_types_rewards_api.txt``), and construction from the seed's Python types."""

from __future__ import annotations

import ast
import dataclasses
import math
import typing

import pytest
import torch

import maxent_arrow
from maxent_arrow.types import records_equal, rewards, settings

REQUIRED = object()

# The seed's fields, in order: (name, annotation as the seed prints it, default).
SEED_FIELDS: dict[str, list[tuple[str, str, object]]] = {
    "AdvantageStats": [
        ("grouped", "List[List[float]]", REQUIRED),
        ("samples", "List[float]", REQUIRED),
    ],
    "BatchDiagnostics": [
        ("kl_value", "float | None", REQUIRED),
        ("clip_ratio", "float", REQUIRED),
        ("clip_ratio_low_mean", "float", REQUIRED),
        ("clip_ratio_low_min", "float", REQUIRED),
        ("clip_ratio_high_mean", "float", REQUIRED),
        ("clip_ratio_high_max", "float", REQUIRED),
        ("clip_ratio_region_mean", "float", REQUIRED),
        ("kl_per_token_by_len_bucket", "Dict[str, float]", REQUIRED),
        ("kl_token_count_by_len_bucket", "Dict[str, float]", REQUIRED),
    ],
    "GenerationBatch": [
        ("prompts", "List[str]", REQUIRED),
        ("answers", "List[str]", REQUIRED),
        ("grouped_completions", "List[List[str]]", REQUIRED),
        ("grouped_ref_meta", "List[List[Any | None]] | None", REQUIRED),
        ("grouped_completion_info", "List[List[Dict[str, Any]]] | None", None),
    ],
    "LengthStats": [
        ("min_length", "float", REQUIRED),
        ("mean_length", "float", REQUIRED),
        ("max_length", "float", REQUIRED),
        ("clipped_ratio", "float", REQUIRED),
        ("min_terminated", "float", REQUIRED),
        ("mean_terminated", "float", REQUIRED),
        ("max_terminated", "float", REQUIRED),
    ],
    "LossOutputs": [
        ("loss", "Any", REQUIRED),
        ("scalars", "LossScalarBundle", REQUIRED),
        ("log_ratio_train", "Any", REQUIRED),
        ("denom_tok_tensor", "Any", REQUIRED),
    ],
    "LossScalarBundle": [
        ("total_loss", "float", REQUIRED),
        ("policy_loss", "float", REQUIRED),
        ("clip_loss", "float | None", REQUIRED),
        ("kl_loss", "float", REQUIRED),
        ("weighted_kl_loss", "float", REQUIRED),
    ],
    "PromptCacheEntry": [
        ("input_ids", "List[int]", REQUIRED),
        ("attention_mask", "List[int]", REQUIRED),
    ],
    "PromptCompletionBatch": [
        ("prompts", "List[str]", REQUIRED),
        ("completions", "List[str]", REQUIRED),
        ("metadata", "List[Dict[str, Any]] | None", None),
    ],
    "QDistribution": [
        ("grouped", "List[List[float]]", REQUIRED),
        ("samples", "List[float]", REQUIRED),
    ],
    "ReferenceLogprobs": [
        ("ref_logp_sum", "Any", REQUIRED),
        ("ref_tok_counts", "Any", REQUIRED),
        ("ref_logp_sum_raw", "Any", REQUIRED),
        ("ref_logp_mean", "float", REQUIRED),
        ("avg_completion_tokens", "float", REQUIRED),
        ("ref_token_logp", "Any | None", None),
        ("ref_token_mask", "Any | None", None),
    ],
    "RewardComputation": [
        ("total_utils", "List[float]", REQUIRED),
        ("per_reward_values", "Dict[str, List[float]]", REQUIRED),
        ("advantage", "AdvantageStats", REQUIRED),
        ("pairs", "PromptCompletionBatch", REQUIRED),
        ("q_distribution", "QDistribution", REQUIRED),
        ("moments", "RewardMoments", REQUIRED),
        ("ref_logprob_meta", "List[Any | None] | None", None),
        ("completion_metadata", "List[Dict[str, Any]] | None", None),
        ("entropy_bonus_scale", "float | None", None),
        ("seed_semantic_entropies", "List[float] | None", None),
        ("seed_advantage_scales", "List[float] | None", None),
        ("seed_alpha_effective", "float | None", None),
        ("seed_max_possible_entropy", "float | None", None),
    ],
    "RewardMoments": [
        ("mean", "float", REQUIRED),
        ("std", "float", REQUIRED),
    ],
    "ScoreBatch": [
        ("prompt_entries", "List['PromptCacheEntry']", REQUIRED),
        ("completion_ids", "Tensor", REQUIRED),
        ("completion_attention_mask", "Tensor", REQUIRED),
        ("pad_token_id", "int", REQUIRED),
        ("max_prompt_len", "int", REQUIRED),
        ("slice_size", "int", REQUIRED),
        ("total_sequences", "int", REQUIRED),
        ("score_tail_tokens", "int | None", None),
    ],
    "SequenceScores": [
        ("cur_logp_sum", "Any", REQUIRED),
        ("behavior_logp_sum", "Any", REQUIRED),
        ("log_ratio_train", "Any", REQUIRED),
        ("denom_tok_tensor", "Any", REQUIRED),
        ("pooled_hidden", "Any | None", None),
        ("policy_entropy_sum", "Any | None", None),
        ("token_logp", "Any | None", None),
        ("token_mask", "Any | None", None),
        ("old_token_logp", "Any | None", None),
    ],
    "ValidationContext": [
        ("evaluation", "EvaluationSettings", REQUIRED),
        ("accelerator", "Accelerator", REQUIRED),
        ("model", "PreTrainedModel", REQUIRED),
        ("tokenizer", "PreTrainedTokenizer", REQUIRED),
        ("reward", "RewardSpec", REQUIRED),
        ("generator", "GenerationFn[Any]", REQUIRED),
        ("logging", "LoggingHandles", REQUIRED),
        ("eval_reward", "RewardSpec | None", None),
        ("runtime", "'RuntimeHandles' | None", None),
        ("generation", "'GenerationSettings' | None", None),
        ("scoring", "'ScoringSettings' | None", None),
    ],
}

# The seed's properties: (name, return annotation).
SEED_PROPERTIES: dict[str, list[tuple[str, str]]] = {
    "LossOutputs": [
        ("total_loss_scalar", "float"),
        ("policy_loss_scalar", "float"),
        ("clip_loss_scalar", "float | None"),
        ("kl_loss_scalar", "float"),
        ("weighted_kl_loss_scalar", "float"),
    ],
    "PromptCacheEntry": [("length", "int")],
    "RewardComputation": [
        ("advantage_samples", "List[float]"),
        ("q_grouped", "List[List[float]]"),
        ("train_reward_mean", "float"),
        ("train_reward_std", "float"),
    ],
}

# Live handles of optional packages: annotated ``Any`` so `import maxent_arrow` does not import
# accelerate or transformers.
HANDLE_FIELDS = {("ValidationContext", f) for f in ("accelerator", "model", "tokenizer")}


def normalise(annotation: str) -> str:
    """An annotation in one spelling: ``List``/``Dict`` -> ``list``/``dict``, ``Optional[X]``
    -> ``X | None``, no forward quotes (the seed's API text prints ``Optional[X]`` as
    ``X | None``)."""
    tree = ast.parse(annotation.replace("'", "").replace('"', ""), mode="eval").body

    def text(node: ast.expr) -> str:
        if isinstance(node, ast.Subscript):
            base = text(node.value)
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if base == "Optional":
                return f"{text(items[0])} | None"
            base = {"List": "list", "Dict": "dict"}.get(base, base)
            return f"{base}[{', '.join(text(i) for i in items)}]"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return f"{text(node.left)} | {text(node.right)}"
        return ast.unparse(node)

    return text(tree)


def test_the_fifteen_names_are_defined_and_reexported():
    assert sorted(rewards.__all__) == sorted(SEED_FIELDS)
    for name in SEED_FIELDS:
        cls = getattr(rewards, name)
        assert getattr(maxent_arrow, name) is cls
        assert dataclasses.is_dataclass(cls) and isinstance(cls, type)
        assert name in maxent_arrow.__all__


@pytest.mark.parametrize("name", sorted(SEED_FIELDS))
def test_fields_order_annotations_and_defaults_match_the_seed(name):
    cls = getattr(rewards, name)
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields] == [n for n, _, _ in SEED_FIELDS[name]]
    for field, (_, annotation, default) in zip(fields, SEED_FIELDS[name]):
        if default is REQUIRED:
            assert field.default is dataclasses.MISSING, field.name
            assert field.default_factory is dataclasses.MISSING, field.name
        else:
            assert field.default == default, field.name
        if (name, field.name) not in HANDLE_FIELDS:
            assert normalise(str(field.type)) == normalise(annotation), field.name
    typing.get_type_hints(cls)  # every annotation resolves


@pytest.mark.parametrize("name", sorted(SEED_FIELDS))
def test_properties_match_the_seed(name):
    cls = getattr(rewards, name)
    expected = SEED_PROPERTIES.get(name, [])
    found = sorted(n for n, v in vars(cls).items() if isinstance(v, property))
    assert found == sorted(n for n, _ in expected)
    for prop, annotation in expected:
        returned = typing.get_type_hints(getattr(cls, prop).fget)["return"]
        assert normalise(typing_text(returned)) == normalise(annotation), prop


def typing_text(annotation: object) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


# ---------------------------------------------------------------------------- construction
def build_all() -> dict[str, object]:
    """One record of each class, from the Python types the seed's producers pass."""
    pairs = rewards.PromptCompletionBatch(
        prompts=["2+2?", "2+2?", "3+3?"],
        completions=["4", "5", "6"],
        metadata=[{"token_count": 1}, {"token_count": 1}, {"finish_reason": "stop"}],
    )
    advantage = rewards.AdvantageStats(grouped=[[0.7, -0.7], [0.0]], samples=[0.7, -0.7, 0.0])
    q = rewards.QDistribution(grouped=[[0.6, 0.4], [1.0]], samples=[0.6, 0.4, 1.0])
    moments = rewards.RewardMoments(mean=0.5, std=0.25)
    scalars = rewards.LossScalarBundle(1.5, 1.0, None, 0.5, 0.05)
    entry = rewards.PromptCacheEntry(input_ids=[11, 12, 13], attention_mask=[1, 1, 1])
    return {
        "AdvantageStats": advantage,
        "BatchDiagnostics": rewards.BatchDiagnostics(
            0.01, 0.1, 0.05, 0.0, 0.05, 1.0, 0.1, {"0-32": 0.02}, {"0-32": 12.0}
        ),
        "GenerationBatch": rewards.GenerationBatch(
            prompts=["2+2?", "3+3?"],
            answers=["4", "6"],
            grouped_completions=[["4", "5"], ["6"]],
            grouped_ref_meta=[[{"logprob_sum": -1.0, "token_count": 1}, None], [None]],
            grouped_completion_info=[[{"token_ids": [52]}, {"token_ids": [53]}], [{}]],
        ),
        "LengthStats": rewards.LengthStats(1, 1.5, 2, 0.0, 1, 1.5, 2),
        "LossOutputs": rewards.LossOutputs(
            loss=torch.tensor(1.5, requires_grad=True),
            scalars=scalars,
            log_ratio_train=torch.tensor([0.1, -0.2, 0.0]),
            denom_tok_tensor=torch.tensor([1.0, 2.0, 1.0]),
        ),
        "LossScalarBundle": scalars,
        "PromptCacheEntry": entry,
        "PromptCompletionBatch": pairs,
        "QDistribution": q,
        "ReferenceLogprobs": rewards.ReferenceLogprobs(
            ref_logp_sum=torch.tensor([-1.0, -0.5, -2.0]),
            ref_tok_counts=torch.tensor([1.0, 2.0, 1.0]),
            ref_logp_sum_raw=torch.tensor([-1.0, -1.0, -2.0]),
            ref_logp_mean=-4 / 3,
            avg_completion_tokens=4 / 3,
        ),
        "RewardComputation": rewards.RewardComputation(
            total_utils=[1.0, 0.0, 1.0],
            per_reward_values={"reward_0": [1.0, 0.0, 1.0]},
            advantage=advantage,
            pairs=pairs,
            q_distribution=q,
            moments=moments,
        ),
        "RewardMoments": moments,
        "ScoreBatch": rewards.ScoreBatch(
            prompt_entries=[entry, entry, entry],
            completion_ids=torch.tensor([[52, 0], [53, 54], [54, 0]]),
            completion_attention_mask=torch.tensor([[1, 0], [1, 1], [1, 0]]),
            pad_token_id=0,
            max_prompt_len=16,
            slice_size=3,
            total_sequences=3,
        ),
        "SequenceScores": rewards.SequenceScores(
            cur_logp_sum=torch.tensor([-1.0, -2.0, -0.5], requires_grad=True),
            behavior_logp_sum=torch.tensor([-1.1, -2.1, -0.6]),
            log_ratio_train=torch.tensor([0.0, -1.0, 1.5]),
            denom_tok_tensor=torch.tensor([1.0, 2.0, 1.0]),
        ),
    }


def test_every_data_class_builds_from_required_fields_with_seed_defaults():
    records = build_all()
    assert sorted(records) == sorted(set(SEED_FIELDS) - {"ValidationContext"})
    for name, record in records.items():
        required = {n: getattr(record, n) for n, _, d in SEED_FIELDS[name] if d is REQUIRED}
        minimal = type(record)(**required)
        for field, _, default in SEED_FIELDS[name]:
            if default is not REQUIRED:
                assert getattr(minimal, field) is None, (name, field)


@pytest.mark.parametrize("name", sorted(set(SEED_FIELDS) - {"ValidationContext"}))
def test_replace_fields_and_asdict_work(name):
    record = build_all()[name]
    first = dataclasses.fields(record)[0].name
    again = dataclasses.replace(record)
    assert again == record and again is not record
    assert [f.name for f in dataclasses.fields(record)] == [n for n, _, _ in SEED_FIELDS[name]]
    as_dict = dataclasses.asdict(record)
    assert list(as_dict) == [n for n, _, _ in SEED_FIELDS[name]]
    assert getattr(record, first) is not None
    for field, value in as_dict.items():  # asdict keeps every value (dict subclasses too)
        original = getattr(record, field)
        if dataclasses.is_dataclass(original):
            assert value == dataclasses.asdict(original), field
        elif isinstance(original, list) and original and dataclasses.is_dataclass(original[0]):
            assert value == [dataclasses.asdict(x) for x in original], field
        elif isinstance(original, torch.Tensor):
            assert torch.equal(value, original), field
        elif isinstance(original, dict):
            assert dict(value) == dict(original) and len(value) == len(original), field
        else:
            assert value == original, field


def test_replace_keeps_the_new_value_as_given():
    q = build_all()["QDistribution"]
    new_groups = [[0.5, 0.5]]
    changed = dataclasses.replace(q, grouped=new_groups, samples=[0.5, 0.5])
    assert changed.grouped is new_groups and changed.grouped == [[0.5, 0.5]]
    assert q.grouped == [[0.6, 0.4], [1.0]]  # the original is untouched


def test_properties_forward_like_the_seed():
    records = build_all()
    loss = records["LossOutputs"]
    assert loss.total_loss_scalar == 1.5 and loss.policy_loss_scalar == 1.0
    assert loss.clip_loss_scalar is None
    assert loss.kl_loss_scalar == 0.5 and loss.weighted_kl_loss_scalar == 0.05
    assert loss.loss.requires_grad  # the graph is kept in memory
    assert records["PromptCacheEntry"].length == 3
    rc = records["RewardComputation"]
    assert rc.advantage_samples == [0.7, -0.7, 0.0]
    assert rc.q_grouped == [[0.6, 0.4], [1.0]]
    assert rc.train_reward_mean == 0.5 and rc.train_reward_std == 0.25
    assert records["SequenceScores"].cur_logp_sum.requires_grad


def test_reward_computation_is_mutated_in_place_like_the_seed_pipeline():
    rc = build_all()["RewardComputation"]
    rc.total_utils = [2.0, 1.0, 0.0]
    rc.per_reward_values["entropy_bonus"] = [0.1, 0.2, 0.3]
    rc.advantage = rewards.AdvantageStats(grouped=[[1.0, -1.0], [0.0]], samples=[1.0, -1.0, 0.0])
    rc.moments = rewards.RewardMoments(mean=1.0, std=0.8)
    rc.entropy_bonus_scale = 0.8
    assert isinstance(rc.total_utils, list) and rc.total_utils == [2.0, 1.0, 0.0]
    assert isinstance(rc.per_reward_values["entropy_bonus"], list)
    assert list(rc.per_reward_values) == ["reward_0", "entropy_bonus"]
    assert rc.advantage_samples == [1.0, -1.0, 0.0] and rc.train_reward_std == 0.8
    back = rewards.RewardComputation.from_arrow(rc.to_arrow())
    assert back == rc


def test_lists_numpy_and_tensors_are_accepted_for_list_fields():
    import numpy as np

    from_numpy = rewards.AdvantageStats(
        grouped=[np.array([0.5, -0.5]), torch.tensor([0.0])], samples=np.array([0.5, -0.5, 0.0])
    )
    from_tensor = rewards.AdvantageStats(
        grouped=[[0.5, -0.5], [0.0]], samples=torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)
    )
    with pytest.raises(ValueError):  # plain dataclass `==`: numpy's truth value is ambiguous
        assert from_numpy == from_tensor
    assert records_equal(from_numpy, from_tensor)  # by value
    assert records_equal(rewards.AdvantageStats.from_arrow(from_numpy.to_arrow()), from_tensor)
    # Values are kept as given (the seed coerces nothing); to_arrow converts them.
    ints = rewards.RewardMoments(mean=1, std=np.float32(0.5))
    assert type(ints.mean) is int and ints.std == 0.5
    assert rewards.RewardMoments.from_arrow(ints.to_arrow()) == rewards.RewardMoments(1.0, 0.5)
    scores = rewards.SequenceScores([-1.0, -2.0], [-1.0, -2.0], [0.0, 0.0], [1.0, 2.0])
    assert scores.cur_logp_sum == [-1.0, -2.0]
    stored = scores.to_arrow()
    assert stored.column("cur_logp_sum").to_pylist() == [-1, -2]
    assert rewards.SequenceScores.from_arrow(stored) == scores  # lists come back as lists
    batch = rewards.ScoreBatch(
        prompt_entries=[rewards.PromptCacheEntry([1], [1])],
        completion_ids=[[5, 6]],
        completion_attention_mask=[[1, 1]],
        pad_token_id=0,
        max_prompt_len=4,
        slice_size=1,
        total_sequences=1,
    )
    assert batch.completion_ids == [[5, 6]]
    assert batch.to_arrow().column("completion_ids").to_pylist() == [[5, 6]]
    assert records_equal(rewards.ScoreBatch.from_arrow(batch.to_arrow()), batch)
    assert math.isclose(rewards.LengthStats(1, 2, 3, 0, 1, 2, 3).mean_length, 2.0)


# ---------------------------------------------------------------------------- ValidationContext
def test_settings_module_has_the_types_validation_context_names():
    hints = typing.get_type_hints(rewards.ValidationContext)
    for name in (
        "EvaluationSettings",
        "RewardSpec",
        "GenerationFn",
        "LoggingHandles",
        "RuntimeHandles",
        "GenerationSettings",
        "ScoringSettings",
    ):
        assert isinstance(getattr(settings, name), type), name
        assert name in settings.__all__
    assert hints["evaluation"] is settings.EvaluationSettings
    assert hints["runtime"] == settings.RuntimeHandles | None
    assert typing.get_origin(hints["generator"]) is settings.GenerationFn
    with pytest.raises(ValueError, match="expected 2 weights"):
        settings.RewardSpec(reward_funcs=[len, len], reward_weights=[1.0])


@pytest.mark.slow
def test_validation_context_holds_live_handles():
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=384, n_layer=2, n_embd=64, n_head=2, bos_token_id=1, eos_token_id=1
    )
    model = transformers.GPT2LMHeadModel(config)
    tokenizer = transformers.ByT5Tokenizer()

    def exact_match(completions, answers, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answers)]

    def generate(prompts, num_samples, *args, **kwargs):
        ids = tokenizer(prompts, return_tensors="pt", padding=True).input_ids
        out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        texts = tokenizer.batch_decode(out[:, ids.shape[1] :])
        return [[t] * num_samples for t in texts], None

    reward = settings.RewardSpec(reward_funcs=[exact_match], reward_weights=[1.0])
    ctx = rewards.ValidationContext(
        evaluation=settings.EvaluationSettings(enabled=True, rows=[{"prompt": "1+1"}]),
        accelerator=accelerate.Accelerator(cpu=True),
        model=model,
        tokenizer=tokenizer,
        reward=reward,
        generator=generate,
        logging=settings.LoggingHandles(),
    )
    assert ctx.eval_reward is None and ctx.runtime is None
    assert ctx.generation is None and ctx.scoring is None
    grouped, _ = ctx.generator(["1+1"], 2)
    assert len(grouped) == 1 and len(grouped[0]) == 2
    assert ctx.reward.reward_funcs[0](["2"], ["2"]) == [1.0]
    changed = dataclasses.replace(ctx, scoring=settings.ScoringSettings(slice_size=4))
    assert changed.scoring.slice_size == 4 and changed.model is model
    assert not hasattr(rewards.ValidationContext, "to_arrow")
