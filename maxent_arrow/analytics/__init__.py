"""Analytics over a saved run: DuckDB views, the ready-made queries, the plotted report and
exports (Arrow IPC, Hugging Face ``datasets``).

Names load on first use; importing this package imports no torch.
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".run": ["RunAnalytics", "open_run", "DEFAULT_QUANTILES"],
        ".report": ["Report", "build_report"],
        ".export": ["export_hf", "export_ipc"],
        ".relations": ["RunRelations"],
        ".queries": ["ReadyMadeQueries"],
    },
)
