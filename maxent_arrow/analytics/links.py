"""The explorer's page addresses (``maxent-arrow view``): one home for its URL scheme.

The explorer serves these paths and the report links to them, so both are written here, below
both. A report written by ``maxent-arrow report`` links to :data:`DEFAULT_VIEW_URL`, where
``maxent-arrow view RUN`` listens by default.
"""

from __future__ import annotations

from urllib.parse import urlencode

__all__ = [
    "DEFAULT_VIEW_PORT",
    "DEFAULT_VIEW_URL",
    "group_id_path",
    "group_path",
    "step_path",
    "tokens_path",
]

DEFAULT_VIEW_PORT = 8765
DEFAULT_VIEW_URL = f"http://127.0.0.1:{DEFAULT_VIEW_PORT}"


def _query(kind: str, attempts: str | None, **more: str | None) -> str:
    params = {"kind": kind}
    if attempts and attempts != "effective":
        params["attempts"] = attempts
    params.update({k: v for k, v in more.items() if v})
    return "?" + urlencode(params)


def step_path(step: int, kind: str, *, attempts: str | None = None) -> str:
    """The step page: its groups, sortable and filterable."""
    return f"/step/{int(step)}" + _query(kind, attempts)


def group_path(
    step: int,
    rank: int,
    group_index: int,
    kind: str,
    *,
    attempts: str | None = None,
    attempt: str | None = None,
) -> str:
    """The group page of the group row (step, rank, kind, group_index); ``attempt`` picks
    the row of one attempt where several wrote the step (``attempts="all"``)."""
    return f"/group/{int(step)}/{int(rank)}/{int(group_index)}" + _query(
        kind, attempts, attempt=attempt
    )


def group_id_path(step: int, kind: str, group_id: str) -> str:
    """The group page of the first row of group ``group_id`` at ``step`` (a group a trainer
    spread over ranks has a row per rank; the report names groups by ``group_id``)."""
    return f"/group-id/{int(step)}?" + urlencode({"kind": kind, "id": group_id})


def tokens_path(
    step: int,
    rank: int,
    group_index: int,
    sample: int,
    kind: str,
    *,
    attempts: str | None = None,
    attempt: str | None = None,
    series: str | None = None,
) -> str:
    """The tokens page of completion ``sample`` of a group row, coloured by ``series``."""
    return f"/tokens/{int(step)}/{int(rank)}/{int(group_index)}/{int(sample)}" + _query(
        kind, attempts, attempt=attempt, series=series
    )
