"""Analytics: SQL and ready-made queries over every saved step, and a plotted report.

python examples/analytics.py [RUN]  (a run directory or its store, e.g. runs/demo/latest;
                                    without RUN a 3-step run is trained first)
"""

import sys
import tempfile
from pathlib import Path

from maxent_arrow import demo
from maxent_arrow.analytics.report import build_report
from maxent_arrow.analytics.run import open_run
from maxent_arrow.errors import ArgumentError

if len(sys.argv) > 1:
    try:
        store = demo.store_of(sys.argv[1])  # RUN or RUN/store: the store
    except ArgumentError as exc:  # neither: said in one line, exit 2 as the CLI does
        print(f"analytics.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
else:
    run = Path(tempfile.mkdtemp()) / "run"
    demo.main(["--out", str(run), "--steps", "3", "--sft-steps", "100", "--quiet", "--no-report"])
    store = run / "store"

with open_run(store) as analytics:
    # Views: groups (one row per prompt group), samples (one per completion), steps.
    print(
        analytics.sql(
            "SELECT step, count(*) AS completions, avg(total_util) AS reward "
            "FROM samples WHERE kind = 'train' GROUP BY step ORDER BY step"
        ).to_pandas()
    )
    print(analytics.reward_curve().to_pandas())  # mean, std, quantiles per step
    print(analytics.length_stats().to_pandas())  # lengths and clipped fraction
    print(analytics.kl_by_length_bucket().to_pandas())

# Into a new directory: the run's own report (the demo's) stays as it is.
report = build_report(store, Path(tempfile.mkdtemp()) / "report", progress=False)
print("report:", report.html)
