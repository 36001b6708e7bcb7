"""Adding a member to another library's Enum class.

diffusers (``AttentionBackendName``, a ``str`` Enum) and xDiT (``AttentionBackendType``, a plain
Enum) choose an attention backend by a member of their enum and have no hook for a third-party
name: :func:`extend_enum` adds one, as ``aenum.extend_enum`` does, so that ``Enum[name]``,
``Enum(value)`` and iteration all see it.
"""

from __future__ import annotations

import sys


def extend_enum(enum_cls, name: str, value):
    """Add member ``name = value`` to ``enum_cls`` (idempotent: an existing member of that value
    is returned); returns the member."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in enum_cls._member_map_:
        raise ValueError(f"{enum_cls.__name__} already has a member {name!r} of another value")
    base = enum_cls._member_type_
    member = object.__new__(enum_cls) if base is object else base.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    if sys.version_info >= (3, 11):
        member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    type.__setattr__(enum_cls, name, member)
    return member
