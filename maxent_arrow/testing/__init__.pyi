# The exports of maxent_arrow.testing: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .batches import (
    CONFIG as CONFIG,
    expected_group_math as expected_group_math,
    make_batch as make_batch,
    make_parts as make_parts,
)
from .streamed import streamed_batch as streamed_batch
from .stores import (
    compacted_run as compacted_run,
    loose_store as loose_store,
    resume_run as resume_run,
    unit_path as unit_path,
)
from .written import (
    Written as Written,
    WrittenGroup as WrittenGroup,
    write_store as write_store,
)
