"""SQL over a store: the pure plan of the views, the checksum ledger, the sandboxed DuckDB
session and the views composed over them.
"""
