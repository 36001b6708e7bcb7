"""Puts op_tests/ (common.py, ci_policy.py, the probes' helpers) and each test group
(ops/, backends/, infra/, integrations/) on sys.path, so a test imports the shared helpers and
a neighbour group's module by name. Imported by conftest.py under pytest and by each group's
_op_tests.py when a test file runs as a script (`python op_tests/<group>/test_x.py`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
GROUPS = ("ops", "backends", "infra", "integrations")

for _d in (ROOT, *(ROOT / g for g in GROUPS)):
    if str(_d) not in sys.path:
        sys.path.insert(1, str(_d))
