"""The small checks every part of ``decode`` shares: a decoded value is of the kind the
protocol says, or a ``BadRequest`` naming its field."""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from .limits import MAX_MAP_KEYS


def protocol_map(d: dict, field: str) -> dict:
    """A map as the protocol means a header or an item: at most MAX_MAP_KEYS keys, each a string."""
    if len(d) > MAX_MAP_KEYS:
        raise BadRequest(field, f"a map of {len(d)} keys (at most {MAX_MAP_KEYS})")
    if any(type(k) is not str for k in d):
        raise BadRequest(field, "its keys must be strings")
    return d


def one_of(v: Any, choices) -> bool:
    """``v in choices`` for any decoded value (a list or map is unhashable: not a member)."""
    return isinstance(v, str) and v in choices


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def text(h: dict, key: str, lo: int, hi: int) -> str:
    v = h.get(key)
    if not isinstance(v, str) or not lo <= len(v) <= hi:
        raise BadRequest(key, f"required: a string of {lo}-{hi} characters")
    return v


def opt_text(it: dict, key: str, f: str) -> str | None:
    v = it.get(key)
    if v is not None and (not isinstance(v, str) or not 1 <= len(v) <= 256):
        raise BadRequest(f"{f}.{key}", "must be a string of 1-256 characters")
    return v


def short(value: Any, limit: int = 80) -> str:
    """A client's value as an error message quotes it: never more than ``limit`` characters."""
    text = repr(value) if not isinstance(value, (str, bytes)) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit + 3 else text[:limit] + "..."
