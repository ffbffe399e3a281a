"""Frame 0 → the header map, at a cost bounded by the frame's bytes, whatever it holds.

The walking helpers here read MessagePack without building it; ``lenient.py`` reuses them
to find the segments a rejected message hands over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import BadRequest
from .fields import protocol_map
from .limits import MAX_MAP_KEYS, SMALL_HEADER, Limits

MAX_DEPTH = 1024  # maps and arrays MessagePack reads inside each other (past it: StackError)


def unpack_header(frame: Any, limits: Limits = Limits()) -> dict:
    """Frame 0 → the header map; any failure is a 400 with rid nil.

    Decoding costs memory in proportion to the frame's bytes (an empty map is 1 byte on
    the wire and ~100 in memory): ``params`` over ``max_params_bytes`` is left unread, and
    the other fields together may build at most ``limits.max_containers`` maps and arrays;
    a field past that is left unread too, and so is one nested deeper than MessagePack
    reads (the fields around it are still read; where even the hand walk cannot pass it,
    none after it). ``decode`` refuses an unread field by name. The header's keys are
    strings, at most MAX_MAP_KEYS, and no map in it names a key twice."""
    try:
        try:
            if frame_len(frame) <= min(SMALL_HEADER, limits.max_params_bytes):  # bounded whatever it holds
                header = msgpack.unpackb(frame, raw=False, strict_map_key=False, object_pairs_hook=one_each)
                if not isinstance(header, dict):
                    raise BadRequest("header", "not a MessagePack map")
                return protocol_map(header, "header")
        except msgpack.StackError:
            pass  # nested past what MessagePack reads: field by field, so the others (the rid) are read
        header, budget = {}, Budget(limits.max_containers)
        for key, value in map_entries(frame):
            key = map_key(key)
            if key is None:
                raise BadRequest("header", "its keys must be strings")
            if key in header:
                raise BadRequest("header", f"a map names key {key!r:.80} more than once")
            if value is None:  # too deep even to walk past: refused, and nothing after it is read
                header[key] = Unread(f"nested deeper than {MAX_DEPTH} levels")
                break
            if key == "params" and value.nbytes > limits.max_params_bytes:
                header[key] = Unread(f"{value.nbytes} bytes exceed max_params_bytes={limits.max_params_bytes}")
                continue
            try:
                header[key] = msgpack.unpackb(value, raw=False, strict_map_key=False,
                                              **(_ONE_EACH if key == "params" else budget.hooks))
            except Budget.Spent:
                header[key] = Unread(f"more than {limits.max_containers} maps and arrays in the header (max_items)")
            except msgpack.StackError:  # refused by name; the fields after it are still read (the rid)
                header[key] = Unread(f"nested deeper than {MAX_DEPTH} levels")
        return protocol_map(header, "header")
    except BadRequest:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadRequest("header", f"not a MessagePack map ({type(exc).__name__})") from exc


def one_each(pairs: list) -> dict:
    """A map from its pairs (every map of a header is built here), each key a string or a bin
    and each once: with a key twice, the checks would read one value and a client mean the
    other (or the one shadowed would name a segment nothing releases)."""
    if any(type(k) is not str and type(k) is not bytes for k, _ in pairs):
        raise BadRequest("header", "its keys must be strings")
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise BadRequest("header", f"a map names key {twice!r:.80} more than once")
    return out


_ONE_EACH = {"object_pairs_hook": one_each}


def unpacker(buf: memoryview) -> msgpack.Unpacker:
    up = msgpack.Unpacker(raw=False, max_buffer_size=max(1, buf.nbytes))
    up.feed(buf)
    return up


def map_entries(frame: Any, trailing_ok: bool = False, lenient: bool = False,
                skips: "HandSkips | None" = None) -> list[tuple[memoryview, memoryview | None]]:
    """A MessagePack map's entries as (encoded key, encoded value), without building any
    of them: ``skip`` walks MessagePack without allocating.

    A map of more than MAX_MAP_KEYS entries is refused (``lenient``: only its first ones
    are read) before any is walked: millions of tiny keys in a few MB blocked the loop
    for half a minute. A value nested past what MessagePack reads is found by hand
    (``Walk``, within ``skips``, shared by the walks of one message); where even that
    fails, the entries end with it, its value None."""
    view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
    if view.nbytes == 0 or not is_map(view[0]):
        raise ValueError("not a map")
    walk, entries = Walk(view, skips or HandSkips()), []
    n = walk.up.read_map_header()
    if n > MAX_MAP_KEYS:
        if not lenient:
            raise BadRequest("header", f"a map of {n} keys (at most {MAX_MAP_KEYS})")
        n, trailing_ok = MAX_MAP_KEYS, True
    for _ in range(n):
        k0 = walk.tell()
        walk.up.skip()
        k1 = walk.tell()
        if not walk.skip():  # the last entry, its value None: where the next one starts is unknown
            return [*entries, (view[k0:k1], None)]
        entries.append((view[k0:k1], view[k1:walk.tell()]))
    if not trailing_ok and walk.tell() != view.nbytes:
        raise msgpack.ExtraData(None, None)
    return entries


class HandSkips:
    """How many values nested past what MessagePack reads one message may have walked by hand
    (each up to DEEP_VALUES values, ~1 us each): the walks of a message share one."""

    def __init__(self, left: int = 4):
        self.left = left


class Walk:
    """MessagePack values one after another, each skipped without being built: by msgpack's
    ``skip``, or, for one nested past the MAX_DEPTH levels msgpack reads, by hand (``skip_deep``,
    as ``skips`` allows; each such skip reads the rest of the buffer again)."""

    def __init__(self, view: memoryview, skips: HandSkips):
        self.view, self.base, self.up, self.skips = view, 0, unpacker(view), skips

    def tell(self) -> int:
        return self.base + self.up.tell()

    def skip(self) -> bool:
        """Past the next value; False where it is nested too deep even to find its end."""
        at = self.tell()
        try:
            self.up.skip()
            return True
        except msgpack.StackError:
            if self.skips.left <= 0:
                return False
            self.skips.left -= 1
            end = skip_deep(self.view, at)
            if end is None:
                return False
            self.base, self.up = end, unpacker(self.view[end:])
            return True


DEEP_VALUES = 1 << 12  # values ``skip_deep`` walks at most (~2 ms here), however the bytes nest
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4, 0xc7: -1, 0xc8: -2, 0xc9: -4}  # length bytes
_FIXED = {0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8,
          0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}  # bytes after the type byte
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # (count bytes, values per count)


def skip_deep(view: memoryview, at: int) -> int | None:
    """Where the value at ``at`` ends, walked by hand with a count of the values still owed
    (no stack, so no depth limit); None if it breaks MessagePack or owes past DEEP_VALUES."""
    owed, end = 1, len(view)
    for _ in range(DEEP_VALUES):
        if not owed or at >= end:
            break
        b, at, owed = view[at], at + 1, owed - 1
        if b <= 0x7f or b >= 0xe0 or b in (0xc0, 0xc2, 0xc3):
            continue
        if b <= 0x8f:
            owed += 2 * (b & 0x0f)
        elif b <= 0x9f:
            owed += b & 0x0f
        elif b <= 0xbf:
            at += b & 0x1f
        elif b in _SIZED:  # str, bin, ext (negative: an ext, whose type byte follows its length)
            k = abs(_SIZED[b])
            at += k + int.from_bytes(view[at: at + k], "big") + (_SIZED[b] < 0)
        elif b in _FIXED:
            at += _FIXED[b]
        elif b in _COUNTED:
            k, per = _COUNTED[b]
            owed += per * int.from_bytes(view[at: at + k], "big")
            at += k
        else:  # 0xc1, never used
            return None
    return at if not owed and at <= end else None


def is_map(first: int) -> bool:
    return first in (0xde, 0xdf) or first & 0xf0 == 0x80


def map_key(buf: memoryview, unicode_errors: str = "strict") -> str | bytes | None:
    """An encoded map key, if it is a str or a bin (checked before anything is built)."""
    first = buf[0]
    if 0xa0 <= first <= 0xbf or 0xd9 <= first <= 0xdb or 0xc4 <= first <= 0xc6:
        return msgpack.unpackb(buf, raw=False, unicode_errors=unicode_errors)
    return None


class Budget:
    """Counts the maps and arrays MessagePack builds; past ``limit`` it stops the decoding."""

    class Spent(Exception):
        pass

    def __init__(self, limit: int):
        self.left = limit
        self.hooks = {"object_pairs_hook": self._count_map, "list_hook": self._count}

    def _count(self, x: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise self.Spent
        return x

    def _count_map(self, pairs: list) -> dict:
        return one_each(self._count(pairs))


@dataclass(frozen=True)
class Unread:
    """A header value left undecoded because it is too big; ``decode`` refuses it by name."""

    problem: str



def frame_len(frame: Any) -> int:
    """A frame's bytes. A zmq.Frame's ``len`` is its size (looking up its ``buffer`` costs
    ~0.7 µs here, twice per request); a memoryview's ``len`` counts items, not bytes."""
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)

