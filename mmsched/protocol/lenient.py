"""The 400 path's reading: which segments a message that broke the contract hands over.

Ownership passes when a request is sent (contract guarantee 4), so even a request that
gets a 400 has its segments unlinked; this reads as much of frame 0 as MessagePack
allows, at a cost in proportion to the frame's bytes.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .header import Budget, HandSkips, Walk, is_map, map_entries, map_key
from .limits import valid_shm_name


def unpack_lenient(frame: Any) -> dict | None:
    """The ``mm_items`` of frame 0 as leniently as MessagePack allows (any map keys, bad
    UTF-8 replaced, trailing bytes ignored, fields left unread by ``unpack_header``), or None.

    Only to find the segments a rejected message names: a header that breaks the contract
    still passed their ownership. Of each item only the fields ``owned_segments`` reads are
    decoded, so the cost stays in proportion to the frame's bytes."""
    try:
        header: dict = {"mm_items": []}
        if b"mm_items" not in bytes(frame):  # no key of that name (a text request's 400): ~0.3 us, not ~22
            return header
        skips = HandSkips()  # for the whole message: its items' walks too
        for key, value in map_entries(frame, trailing_ok=True, lenient=True, skips=skips):
            if value is not None and _text(map_key(key, "replace")) == "mm_items":  # every one: a key
                header["mm_items"] += _lenient_items(value, skips) or []  # named twice still handed over segments
        return header
    except Exception:  # msgpack raises several unrelated types
        return None


_KEPT = ("transport", "pooled", "shm_name")  # what owned_segments reads of an item
# A rejected message's first LENIENT_ITEMS items are searched for the segments it hands over
# (a valid request has at most max_items); what it names past them is left to the sweep.
# Walking 64 M nil items blocked the loop for 32 s and broke a tp=2 group.
LENIENT_ITEMS = 1024


def _lenient_items(buf: memoryview, skips: HandSkips) -> list | None:
    if buf[0] not in (0xdc, 0xdd) and buf[0] & 0xf0 != 0x90:
        return None  # not an array
    walk, items = Walk(buf, skips), []
    for _ in range(min(walk.up.read_array_header(), LENIENT_ITEMS)):
        start = walk.tell()
        if not walk.skip():  # nested too deep even to find where the next item starts
            break
        item = buf[start:walk.tell()]
        if is_map(item[0]):
            kept, names = {}, []
            for key, value in map_entries(item, lenient=True, skips=skips):
                key = _text(map_key(key, "replace"))
                if key in _KEPT and value is not None and kept.get("pooled", False) is False:
                    try:  # (once an item says pooled, its segments are never unlinked, whatever follows)
                        kept[key] = msgpack.unpackb(value, raw=False, unicode_errors="replace", **Budget(0).hooks)
                    except Exception:  # an unreadable value names no segment
                        continue
                    if key == "shm_name":
                        names.append(kept[key])
            items += [{**kept, "shm_name": name} for name in names] or [kept]  # each name it gave
    return items


def _text(key):
    """A key as text, a bin one too: the 400 path looks for what a client meant."""
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key



def owned_segments(header: Any, prefix: str) -> list[str]:
    """Non-pooled, allowed segment names of a message, however malformed the rest is.

    Ownership passes when a request is sent (contract guarantee 4), so even a request
    that gets a 400 has its segments unlinked; a name without the prefix or with
    characters outside the allowed set is never touched.
    """
    items = header.get("mm_items") if isinstance(header, dict) else None
    if not isinstance(items, list):
        return []
    names = []
    for it in items:
        if not isinstance(it, dict) or it.get("pooled", False) is not False:
            continue
        name = it.get("shm_name")
        if it.get("transport") == "shm" and valid_shm_name(name, prefix):
            names.append(name)
    return list(dict.fromkeys(names))

