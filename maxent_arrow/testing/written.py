"""A run written with known values, for checking queries against numpy on the data that was
generated: group sizes 1-6, 0/1 and continuous rewards, a zero-variance group, lengths that
hit the cap, eval steps, reward functions added mid-run, columns an older writer lacked.

The groups and step rows are built as Arrow directly (not from seed objects), so a group can
be of one completion and a column can be missing; :class:`Written` keeps what was written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from maxent_arrow.arrow import schema as S
from maxent_arrow.rollout import RolloutBatch
from maxent_arrow.store import RolloutStore

BUCKETS = list(S.KL_LENGTH_BUCKETS)


@dataclass
class WrittenGroup:
    """One group as :func:`write_store` wrote it (the values of its row).

    Attributes
    ----------
    step, rank, kind, index:
        Where it is (``index``: its ``group_index``).
    prompt:
        Its prompt text.
    utils, adv, q, w:
        ``[K]`` total utilities, advantages, q and MaxEnt weights.
    rewards:
        ``[K]`` values of each reward function, by name.
    lens, truncated:
        ``[K]`` completion lengths and whether each hit the cap.
    completions:
        The ``K`` completion texts.
    """

    step: int
    rank: int
    kind: str
    index: int
    prompt: str
    utils: np.ndarray
    rewards: dict[str, np.ndarray]
    adv: np.ndarray
    q: np.ndarray
    w: np.ndarray
    lens: np.ndarray
    truncated: np.ndarray
    completions: list[str]


@dataclass
class Written:
    """What :func:`write_store` wrote: the store's root, its groups and its step rows.

    Attributes
    ----------
    root:
        The store.
    groups:
        Every group, in the order written (step, then rank, then group).
    step_rows:
        Every step row, as a dict of the step table's columns.
    """

    root: Path
    groups: list[WrittenGroup] = field(default_factory=list)
    step_rows: list[dict[str, Any]] = field(default_factory=list)

    def train(self) -> list[WrittenGroup]:
        """The train groups."""
        return [g for g in self.groups if g.kind == "train"]

    def by_step(self, kind: str = "train") -> dict[int, list[WrittenGroup]]:
        """The groups of ``kind`` by step, in step order."""
        out: dict[int, list[WrittenGroup]] = {}
        for g in self.groups:
            if g.kind == kind:
                out.setdefault(g.step, []).append(g)
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class RunSpec:
    """What :func:`write_store` writes (each field as its parameter of that name says)."""

    steps: Iterable[int] = range(4)
    ranks: int = 2
    prompts: int = 3
    rewards_at: Callable[[int], Sequence[str]] = lambda step: ["accuracy"]
    drop_at: Callable[[int], Iterable[str]] = lambda step: ()
    eval_steps: Iterable[int] = ()
    max_len: int = 24
    cap_in_config: bool = True
    seed: int = 0
    losses: bool = False
    collapse_at: Callable[[int], bool] = lambda step: False
    config: Mapping[str, Any] | None = None


def write_store(
    root: str | os.PathLike[str], spec: RunSpec | None = None, **fields: Any
) -> Written:
    """Write a new store at ``root`` through the append API, from Arrow tables of known values;
    return what was written.

    Parameters
    ----------
    root:
        Where the store is created (its manifest's config: ``max_completion_len=max_len``,
        ``tau=0.5``).
    spec, fields:
        A :class:`RunSpec`, with ``fields`` (any of its fields, by name) replaced; the fields:
    steps, eval_steps:
        The train steps and the eval steps; each is written by every rank.
    ranks, prompts:
        The ranks, and the groups of each step of each rank. Group sizes vary by group
        (K in 1..6); group 1 of each step is zero-variance (all utilities 0.5); lengths hit the
        cap ``max_len`` sometimes.
    rewards_at:
        The reward functions of a step (schema evolution); the first scores 0 or 1, the others
        a value in ``[0, 1)``.
    drop_at:
        Columns that a step's group files lack (an older writer).
    cap_in_config:
        Whether the step rows' config names ``max_completion_len``.
    seed:
        The seed of all the values.
    losses:
        The train step rows carry loss values and a KL (``total_loss``, ``policy_loss``,
        ``kl_loss``, ``weighted_kl_loss``, ``kl_value``).
    collapse_at:
        Whether every group of a train step draws one completion text K times (a collapsed
        policy).
    config:
        More keys of the step rows' run config (the model, the tokenizer...).

    Returns
    -------
    Written
        The root, every group's values and every step row. Step 1 of rank 1 stores its KL by
        length bucket without token counts.
    """
    spec = dataclasses.replace(spec or RunSpec(), **fields)
    steps, ranks, prompts, eval_steps = spec.steps, spec.ranks, spec.prompts, spec.eval_steps
    rewards_at, drop_at, collapse_at = spec.rewards_at, spec.drop_at, spec.collapse_at
    max_len, cap_in_config, losses = spec.max_len, spec.cap_in_config, spec.losses
    config = spec.config
    rng = np.random.default_rng(spec.seed)
    root = Path(root)
    store = RolloutStore.create(root, config={"max_completion_len": max_len, "tau": 0.5})
    out = Written(root)
    jobs = [(s, "train") for s in steps] + [(s, "eval") for s in eval_steps]
    for step, kind in jobs:
        names = rewards_at(step)
        for rank in range(ranks):
            rows: dict[str, list] = {
                f.name: [] for f in S.group_schema(families=("core", "maxent"))
            }
            all_lens, all_utils = [], []
            for gi in range(prompts):
                k = int(rng.integers(1, 7))
                rw = {
                    n: rng.integers(0, 2, k).astype(float) if j == 0 else rng.random(k)
                    for j, n in enumerate(names)
                }
                utils = sum(rw.values()) + (rng.normal(size=k) * 0.01 if gi % 2 else 0.0)
                if gi == 1:
                    utils = np.full(k, 0.5)  # a zero-variance group
                utils = np.asarray(utils, dtype=float)
                adv = (utils - utils.mean()) / (utils.std(ddof=1) + 1e-4) if k > 1 else utils * 0
                q = np.exp(utils - utils.max())
                q /= q.sum()
                w = rng.dirichlet(np.ones(k))
                lens = rng.integers(1, max_len + 6, k).clip(max=max_len)
                trunc = lens >= max_len
                comps = [f"s{step}r{rank}g{gi}c{i} " + "x" * int(lens[i]) for i in range(k)]
                if kind == "train" and collapse_at(step):
                    comps = [f"s{step}r{rank}g{gi} the same"] * k
                ids = [list(rng.integers(0, 300, int(n))) for n in lens]
                g = WrittenGroup(
                    step, rank, kind, gi, f"prompt {gi}", utils, rw, adv, q, w, lens, trunc, comps
                )
                out.groups.append(g)
                all_lens.append(lens)
                all_utils.append(utils)
                rows["step"].append(step)
                rows["rank"].append(rank)
                rows["kind"].append(kind)
                rows["group_index"].append(gi)
                rows["group_id"].append(f"{step}.{rank}.{gi}")
                rows["group_size"].append(k)
                rows["num_completions"].append(k)
                rows["prompt"].append(g.prompt)
                rows["prompt_messages"].append(None)
                rows["answer"].append("42")
                rows["prompt_ids"].append([1, 2, 3])
                rows["completions"].append(comps)
                rows["completion_messages"].append(None)
                rows["completion_index"].append(list(range(k)))
                rows["completion_ids"].append(ids)
                rows["completion_info"].append(
                    [
                        {
                            "finish_reason": "length" if t else "stop",
                            "stop_reason": None,
                            "truncated": bool(t),
                            "token_count": int(n),
                            "extra": "{}",
                        }
                        for n, t in zip(lens, trunc)
                    ]
                )
                rows["ref_meta"].append(["{}"] * k)
                rows["total_utils"].append(utils.tolist())
                rows["reward_names"].append(list(names))
                rows["reward_values"].append([[float(rw[n][i]) for n in names] for i in range(k)])
                rows["advantages"].append(adv.tolist())
                rows["q"].append(q.tolist())
                rows["weights"].append(w.tolist())
                rows["ref_logp_sum_raw"].append((-lens * 0.7).tolist())
                rows["ref_tok_counts"].append(lens.tolist())
                rows["ref_token_logp"].append([[-0.5] * int(n) for n in lens])
                rows["behavior_logp_sum"].append((-lens * 0.6).tolist())
                rows["behavior_token_logp"].append([[-0.4] * int(n) for n in lens])
                rows["policy_entropy_sum"].append((lens * 0.1).tolist())
                rows["seed_semantic_entropy"].append(None)
                rows["seed_advantage_scale"].append(None)
            # Columns the fixture does not fill (the layout's later additions) are nulls.
            rows = {k: v if v else [None] * len(rows["step"]) for k, v in rows.items()}
            table = pa.Table.from_pydict(rows, schema=S.group_schema(families=("core", "maxent")))
            table = table.drop_columns([c for c in drop_at(step) if c in table.column_names])
            lens_all, utils_all = np.concatenate(all_lens), np.concatenate(all_utils)
            kl = {b: float(rng.random()) for b in BUCKETS if rng.random() < 0.8}
            counts = {b: float(rng.integers(1, 500)) for b in kl}
            if step == 1 and rank == 1:
                counts = {}  # a rank that stored values without token counts
            step_row: dict[str, Any] = {
                f.name: None for f in S.step_schema(families=("core", "maxent"))
            }
            step_row.update(
                step=step,
                rank=rank,
                kind=kind,
                num_groups=prompts,
                num_samples=int(lens_all.size),
                reward_mean=float(utils_all.mean()),
                reward_std=float(utils_all.std()),
                mean_length=float(lens_all.mean()),
                kl_length_buckets=list(kl),
                kl_per_token_by_len_bucket=list(kl.values()),
                kl_token_count_by_len_bucket=list(counts.values()) if counts else None,
                config=json.dumps(
                    {**({"max_completion_len": max_len} if cap_in_config else {}), **(config or {})}
                ),
            )
            if losses and kind == "train":
                policy, kl = float(rng.normal()), float(rng.random() * 0.1)
                step_row.update(
                    policy_loss=policy,
                    kl_loss=kl,
                    weighted_kl_loss=0.04 * kl,
                    total_loss=policy + 0.04 * kl,
                    kl_value=kl,
                )
            out.step_rows.append(step_row)
            step_table = pa.Table.from_pylist(
                [step_row], schema=S.step_schema(families=("core", "maxent"))
            )
            store.append(RolloutBatch(table, step_table))
    return out
