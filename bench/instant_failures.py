"""A pytest plugin (`-p instant_failures`, with bench/ on the path) that prints each failure's traceback the moment
the test fails, not in the summary at the end: a command stopped at its limit still shows why its tests failed."""

from __future__ import annotations


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        print(f"\n[FAILED {report.when}] {report.nodeid}\n{report.longreprtext[-4000:]}\n", flush=True)
