# The exports of maxent_arrow.arrow: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .identity import (
    completion_index as completion_index,
    default_group_ids as default_group_ids,
    identity_columns as identity_columns,
)
from .lists import (
    first_null as first_null,
    list_offsets as list_offsets,
    regroup as regroup,
    single_array as single_array,
)
from .ragged import (
    Ragged as Ragged,
    arrow_to_torch as arrow_to_torch,
    torch_to_arrow as torch_to_arrow,
)
