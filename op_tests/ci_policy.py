"""pytest plugin: under ``CI=true`` a test may skip only for absent hardware.

A skip whose reason does not start with :data:`HARDWARE_PREFIX` (a missing compiler, LLVM
tool, sanitizer runtime, Python package, ...) is turned into a failure that names the
reason, so a CI machine that lacks something `.ci/install` should have installed cannot pass
by skipping. Loaded by op_tests/conftest.py; op_tests/infra/test_ci_policy.py proves it.
"""

from __future__ import annotations

import os

import pytest

# Every hardware skip goes through op_tests/common.py:skip_no_hardware, which adds this.
HARDWARE_PREFIX = "absent hardware: "


def ci_mode() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and ci_mode()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if reason.startswith(HARDWARE_PREFIX):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"CI=true forbids this skip: {reason!r}. Only absent hardware may skip "
        f"in CI; install what is missing (.ci/install lists every package)."
    )
