"""Analytics: SQL and ready-made queries over every saved step, and a plotted report.

python examples/analytics.py [RUN_DIR]  (without RUN_DIR a 3-step run is trained first)
"""

import sys
import tempfile
from pathlib import Path

from maxent_arrow import demo
from maxent_arrow.analytics.report import build_report
from maxent_arrow.analytics.run import open_run

run = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "run"
if not (run / "store").exists():
    demo.main(["--out", str(run), "--steps", "3", "--sft-steps", "100", "--quiet", "--no-report"])

with open_run(run / "store") as analytics:
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

report = build_report(run / "store", run / "report", progress=False)
print("report:", report.html)
