"""The ``aiter_sage`` logger: one line per first module build, the integrations' fallbacks and
notes. Visible by default; AITER_SAGE_LOG_LEVEL picks the level. Imports nothing from the
package (the build driver uses it when setup.py loads it without the package)."""

from __future__ import annotations

import logging

from . import env

logger = logging.getLogger("aiter_sage")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _configure_logger() -> None:
    """One line per first build, visible by default; AITER_SAGE_LOG_LEVEL picks the level.

    An unknown level must not make `import aiter_sage` fail: it is ignored with a warning."""
    if logger.handlers:  # the application configured it already
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[aiter_sage] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    raw = env.get("AITER_SAGE_LOG_LEVEL", "INFO")
    level = raw.strip().upper()
    logger.setLevel(level if level in LOG_LEVELS else "INFO")
    if level not in LOG_LEVELS:
        logger.warning(
            "AITER_SAGE_LOG_LEVEL=%r is not a log level; using INFO (valid: %s)",
            raw,
            ", ".join(LOG_LEVELS),
        )


_configure_logger()
