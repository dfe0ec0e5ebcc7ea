"""Adapters to other systems, each over the public names of the packages below it:
Ray Data (:mod:`.ray`), TRL's ``GRPOTrainer`` (:mod:`.trl`: record its rollouts into a store)
and verl's ``DataProto`` (:mod:`.verl`: to and from a store's rows). Each loads its own
optional dependency only when used."""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".ray": [
            "UNIT_COLUMN",
            "ray_collate_fn",
            "read_store",
            "recompute_dataset",
            "recompute_group_math",
            "recompute_store",
            "write_store",
        ],
        ".trl": ["RecordingGRPOTrainer", "RolloutRecorder", "trl_group_table", "trl_run_config"],
        ".verl": ["from_dataproto", "to_dataproto"],
    },
)
