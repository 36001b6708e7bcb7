"""The errors a build raises, each with what to do about it."""

from __future__ import annotations


class CompilerNotFound(RuntimeError):
    """No compiler for a target; the message says what to install."""


class BuildError(RuntimeError):
    """A compile or link failed; the message carries the command and its output."""


class CacheDirError(RuntimeError):
    """The module cache cannot hold or load modules; the message says why and what to set."""


class LockTimeout(TimeoutError):
    """Another process held a build lock longer than AITER_SAGE_LOCK_TIMEOUT; names it."""
