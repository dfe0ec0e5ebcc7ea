# The exports of maxent_arrow.analytics: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .attempts import (
    attempt_statuses as attempt_statuses,
    lifecycle_roles as lifecycle_roles,
    role_lifecycle as role_lifecycle,
    status_text as status_text,
)
from .export import export_hf as export_hf, export_ipc as export_ipc
from .jsonsafe import finite as finite
from .links import DEFAULT_VIEW_PORT as DEFAULT_VIEW_PORT, DEFAULT_VIEW_URL as DEFAULT_VIEW_URL
from .offpolicy import (
    offpolicy_html as offpolicy_html,
    offpolicy_markdown as offpolicy_markdown,
    offpolicy_steps as offpolicy_steps,
    offpolicy_text as offpolicy_text,
)
from .queries import ReadyMadeQueries as ReadyMadeQueries
from .relations import RunRelations as RunRelations
from .report import Report as Report, build_report as build_report
from .summary import tokenizer_text as tokenizer_text
from .run import (
    DEFAULT_QUANTILES as DEFAULT_QUANTILES,
    RunAnalytics as RunAnalytics,
    describe_run as describe_run,
    open_run as open_run,
)
from .sqlerrors import check_sql as check_sql
from .summary import Summary as Summary
