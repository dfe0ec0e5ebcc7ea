# The exports of maxent_arrow.ingest: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .collate import (
    GroupCollator as GroupCollator,
    SAMPLE_COLUMNS as SAMPLE_COLUMNS,
    TOKEN_COLUMNS as TOKEN_COLUMNS,
)
from .packing import (
    ModelChunk as ModelChunk,
    SequenceLayout as SequenceLayout,
    concat_rows as concat_rows,
    iter_chunks as iter_chunks,
    sequence_layout as sequence_layout,
)
from .prompt_cache import PromptCache as PromptCache, tokenizer_identity as tokenizer_identity
from .score_batch import (
    ScoreBatchWorkspace as ScoreBatchWorkspace,
    build_score_batch as build_score_batch,
    ragged_to_device as ragged_to_device,
    resolve_device as resolve_device,
    resolve_pad_token_id as resolve_pad_token_id,
)
