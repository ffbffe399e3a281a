"""Logs read ``[rank1] event key=value rid=...``; ``--log-format json`` gives one JSON object a line."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass

from .errors import describe

logger = logging.getLogger("mmsched")


def event(name: str, level: int = logging.INFO, **fields) -> None:
    """Log one event with key=value fields (rendered by the configured formatter)."""
    if logger.isEnabledFor(level):
        exc_info = fields.pop("exc_info", False)
        logger.log(level, name, exc_info=exc_info, extra={"fields": fields})


SAMPLED_PER_S = 20  # lines a second of one sampled event; the rest are counted


@dataclass(slots=True)
class _Second:
    """One sampled event's current second: when it ends, lines written, lines held back."""
    ends: float = 0.0
    written: int = 0
    held: int = 0


_sampled: dict[str, _Second] = {}
_sampled_lock = threading.Lock()  # the loop and the lane both unlink segments


def sampled_event(name: str, level: int = logging.INFO, **fields) -> None:
    """``event`` for what any client can make happen at will (``bad_request``): at most
    SAMPLED_PER_S lines a second, and the lines held back in a second counted in one
    ``<name>_suppressed count=N`` line, written once that second is over (``flush_sampled``).
    Why: a line costs the leader's loop 25-70 us (a 400 flood at tp=2: 5-7 k/s logged, 12-13 k/s
    not), and a misconfigured client would fill the disk. The results metric counts them all."""
    now = time.monotonic()
    with _sampled_lock:
        second = _sampled.setdefault(name, _Second())
        if now >= second.ends:
            _write_held(name, second)
            second.ends, second.written = now + 1.0, 0
        write = second.written < SAMPLED_PER_S
        if write:
            second.written += 1
        else:
            second.held += 1
    if write:
        event(name, level, **fields)


def flush_sampled(everything: bool = False) -> None:
    """Write the counts of seconds that are over (``everything``: of the current one too, at
    stop), so a count never waits for the next line of its event, nor is lost at exit.
    The leader calls it after every batch, heartbeats included."""
    now = time.monotonic()
    with _sampled_lock:
        for name, second in _sampled.items():
            if everything or now >= second.ends:
                _write_held(name, second)


def _write_held(name: str, second: _Second) -> None:
    if second.held:
        event(f"{name}_suppressed", logging.WARNING, count=second.held)
        second.held = 0


class _TextFormatter(logging.Formatter):
    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        kv = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname[0]} [{self.tag}] {record.getMessage()}"
        line = f"{line} {kv}" if kv else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 6), "level": record.levelname.lower(),
               "rank": self.rank, "event": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def _text(v) -> str:
    s = str(v)
    return json.dumps(s) if (" " in s or not s) else s


def setup(rank: int, fmt: str = "text", level: str = "info", role: str | None = None) -> None:
    """``role`` names a process that is no rank (``launcher``, ``sweep``; JSON keeps rank -1)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(rank) if fmt == "json" else _TextFormatter(role or f"rank{rank}"))
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    # other libraries' warnings and errors (aiohttp's, asyncio's) in the same format: without a
    # handler they went out through logging's last resort, plain text in a JSON log
    logging.root.handlers[:] = [handler]
    logging.root.setLevel(max(logging.WARNING, logger.level))
    logging.getLogger("aiohttp.server").addFilter(_client_parse_error)


def _client_parse_error(record: logging.LogRecord) -> bool:
    """aiohttp answers HTTP it cannot parse (a chunk size that is not hex, a body that is not
    what its Content-Encoding says) with a 400 and logs it as an ERROR with a traceback: any
    client could fill the log so. Each becomes one ``bad_http_request`` info line instead."""
    from aiohttp.http_exceptions import HttpProcessingError  # loaded: it is aiohttp logging
    from aiohttp.web_protocol import RequestPayloadError

    exc = record.exc_info[1] if record.exc_info else None
    cause = exc.__cause__ if isinstance(exc, RequestPayloadError) else exc  # a body, logged again after its 400
    if isinstance(cause, HttpProcessingError) and 400 <= (cause.code or 0) < 500:
        error = describe(exc)  # it may quote what the client sent: half a megabyte, in an outside attack
        sampled_event("bad_http_request", peer=record.args[0] if record.args else None,
                      error=error if len(error) <= 300 else error[:300] + " [truncated]")
        return False
    return True
