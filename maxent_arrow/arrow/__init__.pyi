# The exports of maxent_arrow.arrow: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .identity import (
    GroupIdentity as GroupIdentity,
    completion_index_of as completion_index_of,
    default_group_ids as default_group_ids,
)
from .keptsets import (
    KEPT_IDS_TYPE as KEPT_IDS_TYPE,
    decode_gaps as decode_gaps,
    encode_gaps as encode_gaps,
    find_in_sets as find_in_sets,
    first_bad_gap as first_bad_gap,
    kept_ids_array as kept_ids_array,
    token_sets as token_sets,
)
from .lists import (
    first_null as first_null,
    float_values as float_values,
    int64_array as int64_array,
    int64_scalar as int64_scalar,
    list_offsets as list_offsets,
    regroup as regroup,
    single_array as single_array,
    text_array as text_array,
    text_scalar as text_scalar,
    text_values as text_values,
)
from .ragged import (
    Ragged as Ragged,
    arrow_to_torch as arrow_to_torch,
    prefix_lengths as prefix_lengths,
    torch_to_arrow as torch_to_arrow,
)
