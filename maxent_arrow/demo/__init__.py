"""The main job of ``make demo``: a seeded tiny GPT-2 trained on the shipped arithmetic
prompts with two rewards (:mod:`.rewards`), every step stored, then replayed, evaluated and
reported (:mod:`.job`)."""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".job": ["demo_config", "load_prompts", "main", "run"],
        ".model": ["tiny_model"],
        ".rewards": ["accuracy_reward", "final_number", "format_reward"],
    },
)
