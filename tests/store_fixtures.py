"""What the store tests share that is theirs alone. The factories of batches and stores are
public, in :mod:`maxent_arrow.testing` (``make_batch``, ``loose_store``, ``compacted_run``...).
"""

from __future__ import annotations

# A query over every committed group file (the advantages of each step, summed).
ADVANTAGE_SUMS = (
    "SELECT step, sum(list_sum(advantages)) AS s FROM groups GROUP BY step ORDER BY step"
)
