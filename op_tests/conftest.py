"""Test-suite plugins: the CI skip policy (op_tests/ci_policy.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
pytest_plugins = ["ci_policy"]
