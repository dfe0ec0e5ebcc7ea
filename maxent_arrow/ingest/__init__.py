"""Trainer ingestion: Arrow group rows to the tensors a model scores.

:func:`build_score_batch` (a ``ScoreBatch`` in one vectorised pass, optionally on the GPU after
one pinned copy, optionally into the reused buffers of a :class:`ScoreBatchWorkspace`),
packing into padded slices or padding-free rows (:mod:`.packing`), the collate step of a data
loader (:class:`GroupCollator`) and the prompt-token cache (:class:`PromptCache`).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
