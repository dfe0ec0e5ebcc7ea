"""The recorders' background appender: jobs run in order on one thread, at most
``max_pending`` in flight, and a failed append is raised by the caller's next call."""

from __future__ import annotations

import threading
import time

import pytest

from maxent_arrow.errors import StoreError
from maxent_arrow.integrations.appender import Appender


def test_jobs_run_in_order_on_one_background_thread():
    appender = Appender(max_pending=2)
    seen: list[tuple[int, str]] = []

    def job(i):
        def run():
            time.sleep(0.002 * (3 - i % 3))  # later jobs are quicker: order is still kept
            seen.append((i, threading.current_thread().name))

        return run

    for i in range(7):
        appender.submit(job(i))
    appender.close()
    assert [i for i, _ in seen] == list(range(7))
    names = {name for _, name in seen}
    assert len(names) == 1 and names.pop().startswith("maxent-arrow-append")


def test_submit_waits_when_max_pending_jobs_are_in_flight():
    gate = threading.Event()
    appender = Appender(max_pending=1)
    appender.submit(gate.wait)
    waiter = threading.Thread(target=lambda: appender.submit(lambda: None))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # blocked behind the first job
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    appender.close()


def test_a_failed_append_is_raised_by_the_next_call():
    appender = Appender()

    def fail():
        raise StoreError("disk full")

    appender.submit(fail)
    with pytest.raises(StoreError, match="disk full"):
        appender.wait()
    appender.submit(fail)
    time.sleep(0.05)
    with pytest.raises(StoreError, match="disk full"):
        appender.submit(lambda: None)
    appender.close()


def test_without_background_each_job_runs_in_submit():
    appender = Appender(background=False)
    ran = []
    appender.submit(lambda: ran.append(threading.current_thread()))
    assert ran == [threading.main_thread()]
