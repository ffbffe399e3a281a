"""mmsched's own exception tree, in one place.

    MMSchedError
    ├── BadRequest          a message breaks the contract → 400, names the field
    ├── FeatureError        a feature could not be materialized on this rank → 500
    │   └── InjectedFault   raised by --fault, for tests and drills
    ├── GroupBroken         a collective raised or missed its deadline: the group is gone
    ├── ConfigError         a bad setting; the CLI exits 2
    └── ShmFull             the producer could not reserve a segment's pages

OS, zmq and gloo errors are translated at the edges with ``raise ... from exc``;
a feature's original error type is kept in its message ("FileNotFoundError: ...").
"""

from __future__ import annotations


class MMSchedError(Exception):
    """Base of every error mmsched raises on purpose."""


class BadRequest(MMSchedError):
    """The client broke the contract; ``field`` names the offending key."""

    def __init__(self, field: str, problem: str, rid: str | None = None):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.rid = rid


class FeatureError(MMSchedError):
    """A feature failed on this rank; the 500 names it as ``describe(exc)`` gives it (``FeatureError: ...``)."""


class InjectedFault(FeatureError):
    """A failure injected by ``--fault RANK:STAGE:RID_GLOB``."""


class GroupBroken(MMSchedError):
    """A collective raised or passed its deadline: this rank can no longer agree with peers."""


class ConfigError(MMSchedError):
    """A configuration value is unknown, mistyped or out of range."""


class ShmFull(MMSchedError):
    """No room in /dev/shm for a new segment (posix_fallocate failed)."""


def describe(exc: BaseException) -> str:
    """``Type: message`` — how a rank names its error in a 500. Never raises: an exception
    whose ``__str__`` raises or returns a non-string (a plug-in engine's) is named by its type."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - __str__ raised, or returned something not a str
        text = "<unprintable message>"
    return f"{type(exc).__name__}: {text}"
