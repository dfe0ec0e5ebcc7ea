"""Checked by basedpyright from ``tests/test_architecture.py`` (pytest does not collect it):
what a type checker sees of public names of several packages, imported as users import them.
The test compares each ``reveal_type`` with the type in its comment. A package whose exports
a checker cannot see (a hand-written PEP 562 ``__getattr__``) would make them all ``Any``."""

from typing import reveal_type

import maxent_arrow
from maxent_arrow import AdvantageStats, Ragged, RolloutStore, ValidationContext
from maxent_arrow.analytics import RunAnalytics
from maxent_arrow.compute import ClipSettings
from maxent_arrow.errors import StoreError
from maxent_arrow.store import ReadOnlyStore
from maxent_arrow.types.rewards import LossOutputs

reveal_type(RolloutStore)  # type[RolloutStore]
reveal_type(maxent_arrow.RolloutStore)  # type[RolloutStore]
reveal_type(ReadOnlyStore)  # type[ReadOnlyStore]
reveal_type(RunAnalytics)  # type[RunAnalytics]
reveal_type(Ragged)  # type[Ragged]
reveal_type(maxent_arrow.Ragged)  # type[Ragged]
reveal_type(AdvantageStats)  # type[AdvantageStats]
reveal_type(LossOutputs)  # type[LossOutputs]
reveal_type(ValidationContext)  # type[ValidationContext]
reveal_type(ClipSettings)  # type[ClipSettings]
reveal_type(StoreError)  # type[StoreError]
reveal_type(maxent_arrow.__version__)  # str
reveal_type(RolloutStore.create("run"))  # RolloutStore
reveal_type(ReadOnlyStore("run").verify())  # VerifyReport
reveal_type(RolloutStore("run").replay())  # Iterator[RolloutBatch]
