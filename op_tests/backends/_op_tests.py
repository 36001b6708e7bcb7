"""Lets this group's test files run as scripts: puts op_tests/ and its groups on sys.path."""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import suite_paths  # noqa: E402,F401
