"""What one request may ask for, and the fixed bounds of the wire format."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

VERSION = 1
SHM_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
MODALITIES = frozenset({"image", "audio", "video", "other"})
TRANSPORTS = frozenset({"shm", "inline", "cuda_ipc", "session", "memfd"})  # memfd: an extension
REQUEST_TYPES = frozenset({"generate", "embed"})
SMALL_HEADER = 16 << 10  # a header this small is decoded in one call: ~1.5 MB at worst, and 4x faster
MAX_PARAMS_DEPTH = 32  # msgpack refuses to pack past ~1000 levels: a deep params map must not reach the ranks
MAX_MAP_KEYS = 64  # a header or an item has about a dozen keys


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; checked before any allocation."""

    shm_prefix: str = "mmsched_"
    max_input_len: int = 131072
    max_items: int = 64
    max_item_bytes: int = 1 << 30
    max_request_bytes: int = 2 << 30
    max_new_tokens: int = 4096
    default_max_new_tokens: int = 8
    max_message_bytes: int = 256 << 20
    max_params_bytes: int = 64 << 10
    max_params_items: int = 4096

    def __post_init__(self) -> None:
        """A request that omits ``max_new_tokens`` asks for the default, or for the server's
        cap where that is lower (a default above the cap refused every such request, embeds
        included: outside attack, session 54)."""
        if self.default_max_new_tokens > self.max_new_tokens:
            object.__setattr__(self, "default_max_new_tokens", self.max_new_tokens)

    @property
    def max_containers(self) -> int:
        """Maps and arrays a header may hold outside ``params``: the header, ``input_ids``,
        ``mm_items``, and per item its map, ``shape`` and ``ipc`` (with room to spare)."""
        return 16 + 4 * self.max_items


def valid_shm_name(name: Any, prefix: str) -> bool:
    """A segment name mmsched may open or unlink: the prefix, then only [A-Za-z0-9_.-]."""
    return isinstance(name, str) and name.startswith(prefix) and bool(SHM_NAME_RE.fullmatch(name))
