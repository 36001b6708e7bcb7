"""Test-suite plugins: the CI skip policy (op_tests/ci_policy.py); the tests' import path
(suite_paths.py: the shared helpers and every group)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import suite_paths  # noqa: E402,F401

pytest_plugins = ["ci_policy"]
