"""The run's history: the manifest, the commit log (typed operations, state, checkpoints),
the catalog (what is committed, answered by the log or by an older store's listing), attempts,
record tables, the live tail and unified schemas. Imports only :mod:`maxent_arrow.store.storage`.
"""
