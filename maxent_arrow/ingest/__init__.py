"""Trainer ingestion: Arrow group rows to the tensors a model scores.

:func:`build_score_batch` (a ``ScoreBatch`` in one vectorised pass, optionally on the GPU after
one pinned copy, optionally into the reused buffers of a :class:`ScoreBatchWorkspace`),
packing into padded slices or padding-free rows (:mod:`.packing`), the collate step of a data
loader (:class:`GroupCollator`) and the prompt-token cache (:class:`PromptCache`).
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".score_batch": [
            "build_score_batch",
            "ScoreBatchWorkspace",
            "ragged_to_device",
            "resolve_device",
            "resolve_pad_token_id",
        ],
        ".packing": [
            "ModelChunk",
            "SequenceLayout",
            "concat_rows",
            "iter_chunks",
            "sequence_layout",
        ],
        ".collate": ["GroupCollator", "SAMPLE_COLUMNS", "TOKEN_COLUMNS"],
        ".prompt_cache": ["PromptCache", "tokenizer_identity"],
    },
)
