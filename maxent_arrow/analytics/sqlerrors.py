"""A user's SQL mistake, said in full: DuckDB's whole message on one line, and its class.

DuckDB's message of a mistake spans several lines: the error, then its hints ("Did you mean
"samples"?", "Candidate bindings: ..."), then the query line with a caret under the place.
The store's session keeps the first line only; the analytics and the command line give the
whole of it, on one line, with the place as a column number.

The one rule for the exit code (``docs``: the README's command-line section): a statement
DuckDB cannot parse or bind to the views (a syntax error, an unknown table, column or
function: its ``Parser``, ``Binder`` and ``Catalog`` errors) is the user's mistake, a
:class:`QueryError` (exit 2), as are an empty query, several statements or one that is not a
read; an error while the query runs (a value that does not convert, memory, the timeout) is a
:class:`StoreError` (exit 1).
"""

from __future__ import annotations

import re
from typing import Any

from maxent_arrow.errors import QueryError, StoreError
from maxent_arrow.store.sql.session import check_query, duckdb_module

__all__ = ["MISTAKES", "check_sql", "explain_failure", "one_line", "quote_hint", "sql_error"]

# DuckDB's exception classes that mean the statement itself is wrong.
MISTAKES = ("ParserException", "BinderException", "CatalogException")
_EXPLAIN = "EXPLAIN "
_EXPLAINED = re.compile(r"\s*EXPLAIN\b(\s+ANALY[SZ]E\b)?", re.I)
_LINE = re.compile(r"^LINE (\d+): ?(.*)$")
# A statement that reads like the start of a query: the shell split an unquoted one.
_FIRST_WORD = re.compile(r"^\s*(select|with|from|describe|explain|show|summarize)\s*$", re.I)


def one_line(message: str, *, prefix: str = "") -> str:
    """DuckDB's message on one line: the error and its hints, then where it is, as ``(at
    line L, column C: "the part it points at")``. ``prefix``: text this library put before
    the user's statement (``EXPLAIN``), left out of the place."""
    lines = str(message).splitlines()
    text: list[str] = []
    where = ""
    i = 0
    while i < len(lines):
        match = _LINE.match(lines[i])
        if not match:
            if lines[i].strip():
                text.append(lines[i].strip())
            i += 1
            continue
        caret = lines[i + 1] if i + 1 < len(lines) else ""
        code = match.group(2)
        offset = caret.find("^") - (len(lines[i]) - len(code))
        if prefix and match.group(1) == "1" and code.startswith(prefix):
            code, offset = code[len(prefix) :], offset - len(prefix)
        marked = max(1, len(caret.strip()))
        if 0 <= offset < len(code):
            near = code[offset : offset + marked].strip() or code[offset : offset + 20].strip()
            where = f' (at line {match.group(1)}, column {offset + 1}: "{near}")'
        else:
            where = f' (at line {match.group(1)}: "{code.strip()[:60]}")'
        i += 2
    return " ".join(text) + where


def sql_error(exc: BaseException, query: str = "", *, prefix: str = "") -> QueryError | StoreError:
    """The typed error of a failed query: a :class:`QueryError` for a mistake in the
    statement (:data:`MISTAKES`), else a :class:`StoreError`; DuckDB's whole message."""
    text = one_line(str(exc), prefix=prefix)
    if any(base.__name__ in MISTAKES for base in type(exc).__mro__):
        return QueryError(f"query: {text}{quote_hint(query)}{_string_hint(text, query)}")
    return StoreError(f"query failed: {text}")


def quote_hint(query: str) -> str:
    """A hint to quote the SQL when ``query`` is a lone keyword (the shell split it)."""
    if _FIRST_WORD.match(query or ""):
        return (
            f'; the query is only "{query.strip()}": quote the whole SQL as one argument, '
            'e.g. maxent-arrow query RUN "SELECT count(*) FROM samples"'
        )
    return ""


def _string_hint(text: str, query: str) -> str:
    """A hint when an unknown "column" is compared like a value (``kind = train``): text
    values are quoted in SQL."""
    match = re.search(r'Referenced column "([^"]+)" not found', text)
    if match and re.search(rf"(=|<>|!=|\bIN\s*\()\s*{re.escape(match.group(1))}\b", query, re.I):
        return f"; a text value is quoted in SQL: '{match.group(1)}'"
    return ""


def check_sql(query: str) -> str:
    """:func:`~maxent_arrow.store.sql.session.check_query` (one read-only statement), with
    DuckDB's whole message when the statement does not parse."""
    duckdb = duckdb_module()
    try:
        return check_query(query)
    except QueryError:
        try:
            duckdb.extract_statements(query)
        except duckdb.Error as exc:
            raise sql_error(exc, query) from None
        raise


def explain_failure(con: Any, query: str, params: Any, error: StoreError) -> Exception:
    """The error to raise for a user query that failed with ``error`` (the session's
    first-line message): planning it again on ``con`` gives DuckDB's whole message and its
    class when the statement itself is wrong; ``error`` otherwise (it failed while running)."""
    if not str(error).startswith("query failed: "):
        return error  # damage, the timeout, the memory limit: already complete
    explain = _EXPLAINED.match(query)
    if explain is None:
        planned, prefix = _EXPLAIN + query, _EXPLAIN
    else:
        # The user's own EXPLAIN, planned as it is; ANALYZE (which would run the query again)
        # blanked out with as many spaces, so that the place DuckDB names stays the user's.
        a, b = explain.span(1) if explain.group(1) else (0, 0)
        planned, prefix = query[:a] + " " * (b - a) + query[b:], ""
    duckdb = duckdb_module()
    try:
        con.execute(planned, params)
    except duckdb.Error as exc:
        return sql_error(exc, query, prefix=prefix)
    except Exception:  # anything else: the original error stands
        return error
    return error
