"""The explorer's web app: Starlette routes over :class:`~.data.RunData`, read-only.

Safety, in one place:

- only ``GET`` and ``HEAD``; any other method is refused (405), any request with a body
  (413) or a URL over :data:`MAX_URL` bytes (414) too, before a route runs;
- no request names a file: routes take integers (step, rank, group, completion) and a kind
  matched against the store's; assets are a fixed table of the package's own files, read at
  start (no path from a request reaches a file system);
- SQL goes through exactly what ``maxent-arrow query`` runs (``check_sql``, then
  ``RunAnalytics.sql``: one read-only statement, in DuckDB's sandbox over the store's files);
- the one request that writes, an export (only with ``--export-dir``, outside the store), is
  refused when another site's page makes it (``Sec-Fetch-Site``);
- the ``Host`` header must name the address served (a page of another site cannot reach the
  explorer through DNS rebinding); pages are sent with a content security policy that loads
  nothing from elsewhere.
"""

from __future__ import annotations

import io
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

from maxent_arrow import analytics
from maxent_arrow.analytics.attempts import TRAINER
from maxent_arrow.analytics.links import group_path
from maxent_arrow.arrow import registry as R
from maxent_arrow.errors import ArgumentError, MaxentArrowError, QueryError, StoreError
from maxent_arrow.explorer import pages
from maxent_arrow.explorer.data import HISTORIES, History, RunData
from maxent_arrow.explorer.export import export_groups, export_wandb

__all__ = ["ASSETS", "Guard", "MAX_QUERY_ROWS", "MAX_URL", "make_app", "table_csv"]

MAX_URL = 8192
MAX_QUERY_ROWS = 500
# The package's own files the pages load: name -> content type.
ASSETS = {
    "explorer.css": "text/css; charset=utf-8",
    "explorer.js": "text/javascript; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def table_csv(table: Any) -> str:
    """``table`` as CSV, nested values (lists, structs) as JSON text, as ``query --csv``."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    columns = []
    for f in table.schema:
        column = table.column(f.name)
        if pa.types.is_nested(f.type) or pa.types.is_interval(f.type):
            text = [None if v is None else json.dumps(v, default=str) for v in column.to_pylist()]
            column = pa.array(text, pa.string())
        columns.append(column)
    sink = io.BytesIO()
    pacsv.write_csv(pa.table(columns, names=table.column_names), sink)
    return sink.getvalue().decode()


class Guard:
    """ASGI middleware: method, size and host checks before any route."""

    def __init__(self, app: Any, hosts: set[str] | None):
        self.app = app
        self.hosts = hosts  # None: any (the explorer listens on every address)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        size = len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
        host = headers.get("host", "").rsplit(":", 1)[0].strip("[]")
        status, message = 0, ""
        if scope["method"] not in ("GET", "HEAD"):
            status, message = 405, f"{scope['method']}: the explorer is read-only (GET only)"
        elif size > MAX_URL:
            status, message = 414, f"request URL of {size} bytes refused (at most {MAX_URL})"
        elif int(headers.get("content-length") or 0) > 0 or "transfer-encoding" in headers:
            status, message = 413, "a request body is refused (the explorer takes none)"
        elif self.hosts is not None and host not in self.hosts:
            status, message = 421, f"host {host!r} refused (served as {sorted(self.hosts)})"
        if status:
            body = message.encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def make_app(
    data: RunData,
    *,
    other: RunData | None = None,
    hosts: tuple[str, ...] = ("127.0.0.1",),
    export_dir: Path | None = None,
) -> Any:
    """The ASGI app of the explorer over ``data`` (and ``other``, a second run to compare);
    a step's selection may be exported under ``export_dir`` (none: export is off)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route

    uri = data.uri
    folder = resources.files("maxent_arrow.explorer") / "static"
    assets = {name: (folder / name).read_bytes() for name in ASSETS}

    def html(text: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(text, status_code=status, headers=_HEADERS)

    def params_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.query_params.items()}

    def history_of(request: Request) -> History:
        value = request.query_params.get("attempts") or "effective"
        if value not in HISTORIES:
            raise ArgumentError(f"attempts: expected one of {HISTORIES}, got {value!r}")
        return value  # type: ignore[return-value]

    def kind_of(request: Request) -> str:
        return data.check_kind(request.query_params.get("kind") or "train")

    def role_of(request: Request) -> str:
        """Whose lifecycle records the statuses are (the trainer's unless asked)."""
        return request.query_params.get("role") or TRAINER

    def guarded(handler: Any) -> Any:
        def answer(request: Request) -> Response:
            try:
                return handler(request)
            except LookupError as exc:
                return html(pages.error_page(404, str(exc).strip("'\""), uri=uri), 404)
            except (ArgumentError, QueryError, ValueError) as exc:
                return html(pages.error_page(400, str(exc), uri=uri), 400)
            except (MaxentArrowError, OSError) as exc:
                return html(pages.error_page(500, str(exc), uri=uri), 500)

        def endpoint(request: Request) -> Response:
            start = time.perf_counter()
            response = answer(request)
            # The server's share of a page, for the browser's Performance API (the bench).
            spent = (time.perf_counter() - start) * 1e3
            response.headers["Server-Timing"] = f"app;dur={spent:.1f}"
            return response

        return endpoint

    def overview(request: Request) -> Response:
        return html(pages.overview_page(data.overview()))

    def verify(request: Request) -> Response:
        return html(pages.verify_page(data.verify(), uri=uri))

    def step(request: Request) -> Response:
        number = int(request.path_params["step"])
        groups = data.step_groups(number, kind_of(request), history_of(request), role_of(request))
        if not groups.rows:
            raise LookupError(f"no {groups.kind} step {number} in the {groups.history} history")
        params = params_of(request)
        for key, value in params.items():  # numbers are numbers before any row is read
            if key.endswith(("_min", "_max")) and value:
                float(value)
        return html(pages.step_page(groups, params, uri=uri, export=export_dir is not None))

    def export(request: Request) -> Response:
        if export_dir is None:
            message = "export is off: start the explorer with --export-dir DIR (outside the store)"
            return html(pages.error_page(403, message, uri=uri), 403)
        # The one request that writes (outside the store): only from the explorer's own pages
        # or typed in, never from another site's page (a link or an image there).
        site = request.headers.get("sec-fetch-site", "none")
        if site not in ("same-origin", "none"):
            message = f"export refused: requested from another site (Sec-Fetch-Site: {site})"
            return html(pages.error_page(403, message, uri=uri), 403)
        number = int(request.path_params["step"])
        groups = data.step_groups(number, kind_of(request), history_of(request), role_of(request))
        params = params_of(request)
        rows = pages.select_rows(groups, {**params, "kind": groups.kind})
        to = params.pop("to", "hf")
        how = {"hf": export_groups, "wandb": export_wandb}.get(to)
        if how is None:
            raise ArgumentError(f"export: to must be 'hf' or 'wandb', got {to!r}")
        folder = how(
            data, export_dir, step=number, kind=groups.kind, history=groups.history, rows=rows,
            filters={k: v for k, v in params.items() if v and k != "page"},
        )  # fmt: skip
        card = folder / "README.md"
        text = card.read_text(encoding="utf-8") if card.exists() else "(`wandb sync` uploads it)"
        return html(pages.export_page(folder, len(rows), text, uri=uri))

    def group(request: Request) -> Response:
        p = request.path_params
        history = history_of(request)
        attempt = request.query_params.get("attempt") or None
        row = data.group(
            p["step"], p["rank"], p["group"], kind_of(request), history, attempt, role_of(request)
        )
        return html(pages.group_page(row, uri=uri, history=history))

    def group_by_id(request: Request) -> Response:
        step, kind = request.path_params["step"], kind_of(request)
        wanted = request.query_params.get("id") or ""
        rank, group_index = data.find_group(step, kind, wanted)
        return RedirectResponse(group_path(step, rank, group_index, kind), status_code=302)

    def tokens(request: Request) -> Response:
        p = request.path_params
        history, kind = history_of(request), kind_of(request)
        attempt = request.query_params.get("attempt") or None
        found = data.tokens(p["step"], p["rank"], p["group"], p["sample"], kind, history, attempt)
        key = {**dict(zip(R.ROW_KEY, (p["step"], p["rank"], kind, p["group"]))),
               "sample": p["sample"]}  # fmt: skip
        series = request.query_params.get("series")
        page = pages.tokens_page(found, key, series, uri=uri, history=history, attempt=attempt)
        return html(page)

    def compare(request: Request) -> Response:
        example_id = request.query_params.get("example_id")
        prompt = request.query_params.get("prompt")
        kind = kind_of(request)
        what = f"example id {example_id}" if example_id is not None else f"prompt {prompt!r}"
        sections = []
        for title, run in (("this run", data), ("the other run", other)):
            if run is None:
                continue
            found = run.compare(example_id, prompt, kind)
            for r in found:
                r["href"] = group_path(r["step"], r["rank"], r["group_index"], r["kind"])
                if run is other:
                    r["href"] = ""  # the other run is not served; its rows are listed
            sections.append((f"{title}: {run.uri}", found))
        return html(pages.compare_page(sections, what, uri=uri))

    def run_query(sql: str) -> Any:
        analytics.check_sql(sql)
        with analytics.RunAnalytics(data.store()) as run:
            return run.sql(sql)

    listed: dict[str, Any] = {}  # the views and their columns, by log version

    def views() -> dict[str, list[tuple[str, str]]]:
        version = data.store().catalog.version
        if listed.get("version", -1) != version or version is None:
            with analytics.RunAnalytics(data.store()) as run:
                listed.update(version=version, views=run.view_columns())
        return listed["views"]

    def query(request: Request) -> Response:
        sql = request.query_params.get("sql") or ""
        shown = {"uri": uri, "max_rows": MAX_QUERY_ROWS, "views": views()}
        if not sql.strip():
            return html(pages.query_page("", None, None, **shown))
        try:
            result = run_query(sql)
        except (QueryError, StoreError, MaxentArrowError) as exc:
            return html(pages.query_page(sql, None, str(exc), **shown), 400)
        return html(pages.query_page(sql, result, None, **shown))

    def query_csv(request: Request) -> Response:
        sql = request.query_params.get("sql") or ""
        try:
            result = run_query(sql)
        except (QueryError, StoreError, MaxentArrowError) as exc:
            return PlainTextResponse(str(exc), status_code=400, headers=_HEADERS)
        return Response(
            table_csv(result),
            media_type="text/csv; charset=utf-8",
            headers={**_HEADERS, "Content-Disposition": 'attachment; filename="query.csv"'},
        )

    def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            return PlainTextResponse("not found", status_code=404, headers=_HEADERS)
        # The package's own files change only with the package: cached by the browser.
        cache = {**_HEADERS, "Cache-Control": "public, max-age=86400"}
        return Response(assets[name], media_type=ASSETS[name], headers=cache)

    routes = [
        Route("/", guarded(overview)),
        Route("/verify", guarded(verify)),
        Route("/step/{step:int}", guarded(step)),
        Route("/group/{step:int}/{rank:int}/{group:int}", guarded(group)),
        Route("/group-id/{step:int}", guarded(group_by_id)),
        Route("/export/step/{step:int}", guarded(export)),
        Route("/tokens/{step:int}/{rank:int}/{group:int}/{sample:int}", guarded(tokens)),
        Route("/compare", guarded(compare)),
        Route("/query", guarded(query)),
        Route("/query.csv", guarded(query_csv)),
        Route("/static/{name}", asset),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return html(pages.error_page(404, f"no page at {request.url.path}", uri=uri), 404)

    app = Starlette(routes=routes, exception_handlers={404: not_found})
    return Guard(app, None if "*" in hosts else set(hosts) | {"127.0.0.1", "localhost"})
