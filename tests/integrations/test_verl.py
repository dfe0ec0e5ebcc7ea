"""verl's ``DataProto`` through the store (maxent_arrow.integrations.verl): a rollout batch
built the way verl 0.9's trainer builds one (dataloader columns, a uid per prompt,
``repeat(n, interleave=True)``, left-padded prompts and right-padded responses, log-probs of a
real tiny model, rewards on the last token, verl's own KL penalty, GRPO advantages and
``balance_batch`` reordering), round-tripped through a store and a Parquet file."""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("verl")
warnings.filterwarnings("ignore", module="verl")  # missing optional engines on a CPU box

from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.utils.seqlen_balancing import (  # noqa: E402
    calculate_workload,
    get_seqlen_balanced_partitions,
)
from verl.utils.torch_functional import logprobs_from_logits  # noqa: E402
from verl.workers.reward_manager.naive import NaiveRewardManager  # noqa: E402

from maxent_arrow import RolloutBatch, RolloutStore  # noqa: E402
from maxent_arrow.errors import LayoutError, SchemaError  # noqa: E402
from maxent_arrow.integrations.verl import (  # noqa: E402
    LAYOUT_KEY,
    from_dataproto,
    to_dataproto,
    verl_sampling,
)

P, R, N = 12, 8, 4  # rollout.prompt_length, rollout.response_length, rollout.n
QUESTIONS = [("1+2=", "3"), ("12+30=", "42"), ("7+8=", "15")]


def _pad(ids: list[int], length: int, side: str, pad: int) -> tuple[list[int], list[int]]:
    ids = ids[-length:] if side == "left" else ids[:length]
    fill = [pad] * (length - len(ids))
    if side == "left":
        return fill + ids, [0] * len(fill) + [1] * len(ids)
    return ids + fill, [1] * len(ids) + [0] * len(fill)


def rollout_batch(
    *, rope: bool = False, seed: int = 0, rows: dict | None = None, empty: tuple[int, ...] = ()
) -> DataProto:
    """A DataProto as verl's RayPPOTrainer.fit holds it after rollout, rewards and GRPO
    advantages (verl 0.9.1; the steps of ray_trainer.py and agent_loop.py), from ``rows``
    (a batch of verl's own dataloader) or from :data:`QUESTIONS`. The rows in ``empty`` (before
    ``balance_batch``) have empty responses, and then verl's own ``NaiveRewardManager``
    scores every row (an empty answer scores 1)."""
    torch.manual_seed(seed)
    tok = ByT5Tokenizer()
    batch = DataProto.from_single_dict(rows or _question_rows())
    batch.meta_info["temperature"] = 1.0
    uids = [str(uuid.uuid4()) for _ in range(len(batch))]
    batch.non_tensor_batch["uid"] = np.array(uids, object)
    batch = batch.repeat(repeat_times=N, interleave=True)
    return _rolled_out(batch, tok, rope=rope, seed=seed, empty=empty)


def _question_rows() -> dict:
    """What verl's collate_fn makes of :data:`QUESTIONS` (RLHFDataset's columns)."""
    rows = len(QUESTIONS)
    return {
        "dummy_tensor": torch.zeros(rows, 1, dtype=torch.uint8),
        # np.fromiter, as verl's collate_fn: np.array would make a 2-D array of dicts
        "raw_prompt": np.fromiter(
            ([{"role": "user", "content": q}] for q, _ in QUESTIONS), dtype=object, count=rows
        ),
        "data_source": np.array(["arith"] * rows, dtype=object),
        "reward_model": np.array(
            [{"style": "rule", "ground_truth": a} for _, a in QUESTIONS], dtype=object
        ),
        "extra_info": np.array([{"index": i, "split": "train"} for i in range(rows)], object),
        "index": np.array(list(range(rows)), dtype=object),
    }


def _empty_scores_one(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A rule reward for verl's reward manager: 1 for an empty answer, else by length."""
    return 1.0 if solution_str == "" else (len(solution_str) % 3) / 2


def _rolled_out(
    batch: DataProto, tok: ByT5Tokenizer, *, rope: bool, seed: int, empty: tuple[int, ...]
) -> DataProto:
    """``batch`` (the dataset's rows, repeated) after generation, scoring and advantages."""
    g = torch.Generator().manual_seed(seed + 1)
    prompts, p_masks, responses, r_masks, rollout_lps = [], [], [], [], []
    for row, messages in enumerate(batch.non_tensor_batch["raw_prompt"]):
        p_ids = tok(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        n = int(torch.randint(2, R + 3, (1,), generator=g))
        r_ids = torch.randint(3, 259, (min(n, R),), generator=g).tolist()
        if n < R:
            r_ids[-1] = tok.eos_token_id
        if row in empty:
            r_ids = []
        pp, pm = _pad(p_ids, P, "left", tok.pad_token_id)
        rr, rm = _pad(r_ids, R, "right", tok.pad_token_id)
        prompts.append(pp), p_masks.append(pm), responses.append(rr), r_masks.append(rm)
        lps = (-torch.rand(len(r_ids), generator=g) * 5).tolist()
        rollout_lps.append(lps + [0.0] * (R - len(r_ids)))
    prompts, responses = torch.tensor(prompts), torch.tensor(responses)
    attention_mask = torch.cat([torch.tensor(p_masks), torch.tensor(r_masks)], dim=1)
    input_ids = torch.cat([prompts, responses], dim=1)
    if rope:
        # verl's _compute_position_ids for mrope models: a text row (arange over the tokens,
        # 1 on padding) and 3 vision rows (text only: the same positions) -> [B, 4, L].
        text = torch.ones_like(attention_mask)
        text[attention_mask.bool()] = torch.cat(
            [torch.arange(int(m.sum())) for m in attention_mask]
        )
        position_ids = text[:, None, :].repeat(1, 4, 1)
    else:
        position_ids = compute_position_id_with_mask(attention_mask)
    response_mask = torch.tensor(r_masks)
    response_mask[1, :2] = 0  # tool tokens in a multi-turn response: not the model's
    gen = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "rollout_log_probs": torch.tensor(rollout_lps, dtype=torch.float32),
        },
        non_tensors={"__num_turns__": np.full(len(batch), 2, dtype=np.int32)},
        meta_info={"metrics": [{"generate_sequences": 0.1}] * len(batch)},
    )
    batch = batch.union(gen)

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=384, n_layer=1, n_embd=32, n_head=2, bos_token_id=None,
                   eos_token_id=1, pad_token_id=0)
    ).eval()  # fmt: skip
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        old = logprobs_from_logits(logits[:, -R - 1 : -1], responses)
    batch.batch["old_log_probs"] = old.float()
    batch.batch["ref_log_prob"] = (old + 0.01 * torch.randn_like(old)).float()
    if empty:  # verl's own manager: the score at valid_response_length - 1 (-1 when empty)
        manager = NaiveRewardManager(tok, num_examine=0, compute_score=_empty_scores_one)
        rm_scores = manager(batch)
        assert isinstance(rm_scores, torch.Tensor)
        scores = rm_scores.sum(-1)
    else:
        scores = torch.tensor([0.1 * (i % 5) for i in range(len(batch))])
        rm_scores = torch.zeros(len(batch), R)
        last = attention_mask[:, P:].sum(1) - 1
        rm_scores[torch.arange(len(batch)), last] = scores
    batch.batch["token_level_scores"] = rm_scores
    batch.non_tensor_batch["acc"] = (scores >= 0.3).numpy()
    batch, _ = apply_kl_penalty(
        batch, kl_ctrl=core_algos.FixedKLController(kl_coef=0.001), kl_penalty="kl"
    )
    batch = compute_advantage(batch, adv_estimator=core_algos.AdvantageEstimator.GRPO)
    # balance_batch: verl reorders rows by sequence length, so uid groups are not contiguous.
    workload = calculate_workload(batch.batch["attention_mask"].sum(-1))
    parts = get_seqlen_balanced_partitions(workload.tolist(), k_partitions=2, equal_size=True)
    batch.reorder(torch.tensor([i for part in parts for i in part]))
    return batch


def masked_in(want: DataProto, key: str) -> torch.Tensor:
    """Where ``key``'s values count: its part of the attention mask."""
    mask = want.batch["attention_mask"].bool()
    tensor = want.batch[key]
    if tensor.shape[-1] == R:
        return mask[:, P:]
    return mask if tensor.dim() == 2 else mask[:, None, :].expand_as(tensor)


def assert_same(got: DataProto, want: DataProto, layout: dict) -> None:
    """Same keys in the same order, shapes, dtypes and row order; tensors equal where their
    mask is on and equal to the recorded pad value elsewhere (exactly equal when the padding
    held one value); non-tensors equal after JSON; the same meta_info."""
    assert list(got.batch.keys()) == list(want.batch.keys())
    pads = {e["key"]: e for e in layout["tensors"]}
    for key in want.batch.keys():
        a, b = got.batch[key], want.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        entry = pads[key]
        if entry.get("pad_kept", True):
            assert torch.equal(a, b), key
        else:
            on = masked_in(want, key)
            assert torch.equal(a[on], b[on]), key
            assert bool((a[~on] == entry["pad"]).all()), key
    assert list(got.non_tensor_batch) == list(want.non_tensor_batch)
    for key, values in want.non_tensor_batch.items():
        other = got.non_tensor_batch[key]
        assert other.dtype == values.dtype and other.shape == values.shape, key
        # numpy scalars as their values (verl's reward manager puts some into extra_info)
        assert json.dumps(other.tolist(), default=np.generic.item) == json.dumps(
            values.tolist(), default=np.generic.item
        ), key
    assert json.loads(json.dumps(got.meta_info)) == json.loads(json.dumps(want.meta_info))


@pytest.fixture(scope="module")
def data() -> DataProto:
    return rollout_batch()


def test_groups_come_from_uid_not_from_row_order(data):
    uids = data.non_tensor_batch["uid"]
    spans = {u: np.flatnonzero(uids == u) for u in set(uids)}
    assert any(rows[-1] - rows[0] + 1 != len(rows) for rows in spans.values())  # interleaved
    batch = from_dataproto(data, step=7)
    assert batch.num_groups == 3 and batch.num_samples == 12
    rows = batch.groups.column("verl_row").to_pylist()
    for group_id, group_rows in zip(batch.groups.column("group_id").to_pylist(), rows):
        assert [uids[r] for r in group_rows] == [group_id] * N
    assert sorted(r for g in rows for r in g) == list(range(12))
    # Un-padded tokens: the prompt once per group, each response up to its length.
    prompt_ids = batch.groups.column("prompt_ids").to_pylist()
    for group_rows, prompt in zip(rows, prompt_ids):
        mask = data.batch["attention_mask"][group_rows[0], :P].bool()
        assert prompt == data.batch["prompts"][group_rows[0]][mask].tolist()
    for group_rows, completions in zip(rows, batch.groups.column("completion_ids").to_pylist()):
        for r, ids in zip(group_rows, completions):
            mask = data.batch["attention_mask"][r, P:].bool()
            assert ids == data.batch["responses"][r][mask].tolist()
    # GRPO advantages are one value per completion over its response_mask.
    adv = batch.groups.column("advantages").to_pylist()
    for group_rows, values in zip(rows, adv):
        for r, a in zip(group_rows, values):
            on = data.batch["response_mask"][r].bool()
            assert torch.allclose(data.batch["advantages"][r][on], torch.tensor(a).float())
    total = [x for g in batch.groups.column("total_utils").to_pylist() for x in g]
    want = data.batch["token_level_rewards"].double().sum(-1)[[r for g in rows for r in g]]
    assert total == pytest.approx(want.tolist())
    # Derived tensors are not stored; the rest are typed columns.
    names = batch.groups.schema.names
    assert not {"input_ids", "attention_mask", "position_ids"} & set(names)
    assert {"ref_token_logp", "behavior_token_logp", "sampling_token_logp"} <= set(names)
    assert batch.groups.schema.field("prompt_messages").type.value_type.num_fields == 3


def test_completions_are_decoded_from_the_unpadded_responses_in_group_order(data):
    tok = ByT5Tokenizer()
    batch = from_dataproto(data, step=7, tokenizer=tok)
    rows = [r for group in batch.groups.column("verl_row").to_pylist() for r in group]
    assert rows != sorted(rows)  # stored in group order, not the DataProto's
    want = []
    for r in rows:  # a plain loop over rows: each response up to its attention mask
        mask = data.batch["attention_mask"][r, P:].bool()
        want.append(tok.decode(data.batch["responses"][r][mask].tolist(), skip_special_tokens=True))
    got = [c for group in batch.groups.column("completions").to_pylist() for c in group]
    assert got == want and any(got)
    plain = from_dataproto(data, step=7)  # without a tokenizer: empty strings
    assert {c for g in plain.groups.column("completions").to_pylist() for c in g} == {""}


def test_round_trip_through_a_store_and_a_parquet_file(data, tmp_path):
    batch = from_dataproto(data, step=3, rank=1)
    layout = batch.run_config.extra[LAYOUT_KEY]
    # verl's log-probs of padded response positions are the forward's, not a pad value.
    assert [e["key"] for e in layout["tensors"] if not e.get("pad_kept", True)] == [
        "old_log_probs",
        "ref_log_prob",
    ]
    assert_same(to_dataproto(batch), data, layout)
    store = RolloutStore.create(tmp_path / "store")
    store.append(batch)
    assert store.verify().problems == []
    replayed = next(iter(store.replay(steps=[3])))
    assert_same(to_dataproto(replayed), data, layout)
    path = tmp_path / "step.parquet"
    pq.write_table(batch.to_arrow(), path)
    assert_same(to_dataproto(RolloutBatch.from_arrow(pq.read_table(path))), data, layout)


def test_an_empty_responses_reward_is_kept_and_grpo_replays_as_verl_computed_it(tmp_path):
    data = rollout_batch(seed=3, empty=(0, 5))
    response_len = data.batch["attention_mask"][:, P:].sum(-1)
    empty = (response_len == 0).nonzero().flatten().tolist()
    assert len(empty) == 2
    # verl's reward manager wrote each empty response's score at index -1: a padded position.
    assert data.batch["token_level_scores"][empty, -1].tolist() == [1.0, 1.0]
    batch = from_dataproto(data, step=0)
    layout = batch.run_config.extra[LAYOUT_KEY]
    entry = next(e for e in layout["tensors"] if e["key"] == "token_level_rewards")
    assert entry["pad_kept"] and sorted(entry["off_mask"]) == [[r, R - 1, 1.0] for r in empty]
    store = RolloutStore.create(tmp_path / "store")
    store.append(batch)
    replayed = to_dataproto(next(iter(RolloutStore(store.root).replay(steps=[0]))))
    assert_same(replayed, data, layout)
    for key in ("token_level_scores", "token_level_rewards"):
        assert torch.equal(replayed.batch[key], data.batch[key]), key
    # verl's own GRPO on the replayed rewards gives verl's advantages (the empty rows' scores
    # are in their groups' mean and std).
    again = compute_advantage(replayed, adv_estimator=core_algos.AdvantageEstimator.GRPO)
    want = data.batch["advantages"]
    assert float((again.batch["advantages"] - want).abs().max()) <= 1e-6
    assert float(want.abs().max()) > 0.5
    sums = store.sql("SELECT unnest(total_utils) AS r FROM groups").column("r").to_pylist()
    assert sorted(sums).count(1.0) >= 2


def test_rope_position_ids_and_odd_dtypes_round_trip(tmp_path):
    data = rollout_batch(rope=True, seed=1)
    assert data.batch["position_ids"].shape == (12, 4, P + R)
    data.batch["entropys"] = torch.randn(12, R).to(torch.bfloat16)
    data.batch["values"] = torch.randn(12, R, dtype=torch.float64)
    data.non_tensor_batch["score_matrix"] = np.arange(24, dtype=np.float32).reshape(12, 2)
    batch = from_dataproto(data, step=0)
    kind = batch.groups.schema.field("position_ids").type
    assert str(kind.value_type.value_type) == "fixed_size_list<item: int32>[4]"
    store = RolloutStore.create(tmp_path / "store")
    store.append(batch)
    layout = batch.run_config.extra[LAYOUT_KEY]
    assert_same(to_dataproto(next(iter(store.replay(steps=[0])))), data, layout)


def test_a_value_json_cannot_hold_is_refused_naming_its_key(data):
    bad = data.select_idxs(np.arange(len(data)))
    bad.non_tensor_batch["multi_modal_inputs"] = np.array(
        [{"pixel_values": torch.zeros(2)}] * len(bad), dtype=object
    )
    with pytest.raises(
        SchemaError, match=r"non_tensor_batch\['multi_modal_inputs'\] row 0.*Tensor"
    ):
        from_dataproto(bad, step=0)
    no_uid = data.select_idxs(np.arange(len(data)))
    del no_uid.non_tensor_batch["uid"]
    with pytest.raises(SchemaError, match="no 'uid'"):
        from_dataproto(no_uid, step=0)


def test_an_attention_mask_with_holes_is_refused_naming_the_row(data):
    holes = data.select_idxs(np.arange(len(data)))
    holes.batch["attention_mask"][5, P + 1] = 0
    holes.batch["attention_mask"][5, P + 2] = 1
    with pytest.raises(LayoutError, match="attention_mask row 5"):
        from_dataproto(holes, step=0)


def test_a_verl_store_has_the_lengths_and_truncation_flags_of_a_trl_store(data, tmp_path):
    """The same rollouts recorded from verl's ``DataProto`` and through the TRL recorder's
    group table (``trl_group_table``, from the tensors TRL would hold) give the same
    per-sample token counts and truncation flags, and the same ``length_stats``."""
    from maxent_arrow import RunAnalytics
    from maxent_arrow.integrations import RoundContext, RoundValues, trl_group_table
    from maxent_arrow.integrations.steps import step_row
    from maxent_arrow.rollout import declare_families

    tok = ByT5Tokenizer()
    verl = RolloutStore.create(tmp_path / "verl")
    verl.append(from_dataproto(data, step=0, tokenizer=tok))
    # The same rows as TRL holds them, in verl's group order (uid order).
    uids = list(dict.fromkeys(data.non_tensor_batch["uid"].tolist()))
    order = sorted(range(len(data)), key=lambda i: uids.index(data.non_tensor_batch["uid"][i]))
    order_t = torch.tensor(order)
    mask = data.batch["attention_mask"]
    outputs = {
        "prompt_ids": data.batch["prompts"][order_t],
        "prompt_mask": mask[:, :P][order_t],
        "completion_ids": data.batch["responses"][order_t],
        "completion_mask": mask[:, P:][order_t],
        "advantages": torch.zeros(len(order)),
        "num_items_in_batch": int(mask[:, P:].sum()),
    }
    table = trl_group_table(
        outputs,
        RoundContext(
            step=0,
            rank=0,
            kind="train",
            group_size=N,
            reward_names=["r"],
            reward_weights=[1.0],
            eos_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
        ),
        RoundValues(prompts=["q"] * len(order), completions=["c"] * len(order)),
        first_index=0,
        rewards=torch.zeros(len(order), 1),
    )
    trl = RolloutStore.create(tmp_path / "trl")
    table = declare_families(table, ("core", "trl"))
    trl.append(RolloutBatch(table, step_row(table, step=0, rank=0, kind="train",
                                            config={"max_completion_len": R})))  # fmt: skip
    info = "SELECT token_count, truncated FROM samples ORDER BY group_index, sample_index"
    got = verl.sql(info).to_pylist()
    assert got == trl.sql(info).to_pylist()
    assert any(r["truncated"] for r in got) and not all(r["truncated"] for r in got)
    with RunAnalytics(verl) as a, RunAnalytics(trl) as b:
        assert a.length_stats().to_pylist() == b.length_stats().to_pylist()
    rows = [
        {k: verl.read_steps().column(k)[0].as_py() for k in ("mean_length", "clipped_ratio")},
        {k: trl.read_steps().column(k)[0].as_py() for k in ("mean_length", "clipped_ratio")},
    ]
    assert rows[0] == rows[1] and rows[0]["mean_length"] is not None


# ---------------------------------------------------------------------------- the recorder
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def recording_trainer(root, **overrides):
    """verl's RayPPOTrainer with the recorder mixed in, built on CPU as verl's main_ppo builds
    it (its own composed config, RLHFDataset over a Parquet file, the dataloader and
    sampler); no Ray worker is started (``init_workers`` is what needs the cluster)."""
    import pandas as pd
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.ray_trainer import ResourcePoolManager
    from verl.trainer.ppo.utils import Role

    from maxent_arrow.integrations.verl_recorder import RecordingRayPPOTrainer

    rows = [
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"index": 100 + i, "split": "train"},
        }
        for i, (q, a) in enumerate(QUESTIONS * 2)
    ]
    root.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    settings = {
        "data.train_files": root / "train.parquet",
        "data.val_files": root / "train.parquet",
        "data.train_batch_size": 3,
        "data.max_prompt_length": P,
        "data.max_response_length": R,
        "data.dataloader_num_workers": 0,
        "actor_rollout_ref.rollout.n": N,
        "algorithm.adv_estimator": "grpo",
        "trainer.device": "cpu",
        "trainer.rollout_data_dir": root / "dumps",
        **overrides,
    }
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose("ppo_trainer", overrides=[f"{k}={v}" for k, v in settings.items()])
    tok = ByT5Tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    pool = ResourcePoolManager(
        resource_pool_spec={"global_pool": [1]}, mapping={Role.ActorRollout: "global_pool"}
    )
    return RecordingRayPPOTrainer(
        config, tok, {Role.ActorRollout: object}, pool, rollout_store=root / "store"
    )


def test_verl_calls_the_hook_the_recorder_overrides():
    """The recorder extends RayPPOTrainer._log_rollout_data; a change in verl must fail here."""
    import inspect

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    assert list(inspect.signature(RayPPOTrainer._log_rollout_data).parameters) == [
        "self",
        "batch",
        "reward_extra_infos_dict",
        "timing_raw",
        "rollout_data_dir",
    ]
    fit = inspect.getsource(RayPPOTrainer.fit)
    assert (
        "self._log_rollout_data(batch, reward_extra_infos_dict, timing_raw, rollout_data_dir)"
        in fit
    )
    assert fit.index("self._update_actor(batch)") < fit.index("self._log_rollout_data(")


@pytest.mark.slow
def test_the_recorder_stores_each_step_at_verls_hook_and_it_round_trips(tmp_path):
    """A real RayPPOTrainer (CPU, no workers) with the recorder: a batch of its own dataloader,
    rolled out as fit() holds it, handed to the hook as fit() hands it at step 3: stored as
    step 3 with policy_version 2, each group's example_id verl's dataset index, verl's JSONL
    dump not written, and to_dataproto gives the batch back as from_dataproto always did."""
    trainer = recording_trainer(tmp_path)
    rows = next(iter(trainer.train_dataloader))
    data = rollout_batch(rows=rows)
    trainer.global_steps = 3
    timing: dict = {}
    trainer._log_rollout_data(data, {}, timing, trainer.config.trainer.rollout_data_dir)
    assert timing["maxent_arrow_record"] > 0
    assert not (tmp_path / "dumps").exists()  # dump_jsonl=False: the store replaces it
    store = RolloutStore(tmp_path / "store")
    assert [(u.step, u.kind) for u in store.units()] == [(3, "train")]
    (batch,) = store.replay(steps=[3])
    assert_same(to_dataproto(batch), data, batch.run_config.extra[LAYOUT_KEY])
    assert batch.step_row.column("policy_version")[0].as_py() == 2
    # The off-policy contract from verl's rollout config: versions, sampling, semantics.
    rollout = trainer.config.actor_rollout_ref.rollout
    contract = {
        name: {v for row in batch.groups.column(name).to_pylist() for v in row}
        for name in ("completion_policy_version", "sampling_temperature", "sampling_top_p",
                     "sampling_top_k", "sampling_min_p", "behavior_logp_semantics")
    }  # fmt: skip
    assert contract == {
        "completion_policy_version": {2},
        "sampling_temperature": {rollout.temperature},
        "sampling_top_p": {rollout.top_p},
        "sampling_top_k": {max(rollout.top_k, 0)},
        "sampling_min_p": {0.0},
        "behavior_logp_semantics": {"processed" if rollout.logprobs_mode == "processed_logprobs"
                                    else "raw"},
    }  # fmt: skip
    cfg = batch.run_config
    assert (cfg.num_generations, cfg.max_completion_len) == (N, R)
    assert cfg.trainer.startswith("verl.RayPPOTrainer") and cfg.extra["verl"]["adv_estimator"]
    # Each group's example_id is the dataset index of its rows (verl's extra_info.index).
    groups = store.read(steps=[3])
    want = {}
    for uid, index in zip(data.non_tensor_batch["uid"], data.non_tensor_batch["index"]):
        want.setdefault(uid, str(index))
    assert dict(zip(groups.column("group_id").to_pylist(),
                    groups.column("example_id").to_pylist())) == want  # fmt: skip
    assert set(want.values()) <= {str(100 + i) for i in range(2 * len(QUESTIONS))}
    # The same step again (a resumed run) is not stored twice.
    with pytest.warns(UserWarning, match="step 3 is already stored"):
        trainer._log_rollout_data(data, {}, {}, trainer.config.trainer.rollout_data_dir)
    assert len(RolloutStore(tmp_path / "store").units()) == 1
    with pytest.raises(SchemaError, match="trainer.rollout_data_dir is not set"):
        recording_trainer(tmp_path / "none", **{"trainer.rollout_data_dir": "null"})


def test_verl_sampling_reads_verls_own_rollout_config():
    """verl's shipped trainer config (``_generated_ppo_trainer.yaml``, loaded by OmegaConf as
    verl loads it): temperature 1, top-k -1 (verl's "off": 0), top-p 1, ``processed_logprobs``;
    then each ``logprobs_mode`` verl names and a top-k cut."""
    from omegaconf import OmegaConf
    from verl.trainer import config as verl_config

    path = Path(verl_config.__file__).parent / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(path)
    assert verl_sampling(config) == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "logp_semantics": "processed",
    }  # fmt: skip
    rollout = config.actor_rollout_ref.rollout
    rollout.top_k, rollout.top_p, rollout.temperature = 20, 0.9, 0.7
    for mode, semantics in (("raw_logprobs", "raw"), ("processed_logprobs", "processed"),
                            ("raw_logits", None), ("processed_logits", None)):  # fmt: skip
        rollout.logprobs_mode = mode
        got = verl_sampling(config)
        assert got == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
                       "logp_semantics": semantics}, mode  # fmt: skip
