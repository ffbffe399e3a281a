"""Events any client can cause at will are sampled: a flood of 400s is a few lines a second
and one count, not a line per request."""

from __future__ import annotations

import logging

from mmsched import log


def test_a_flood_of_one_event_is_sampled_and_what_was_held_back_is_counted(monkeypatch):
    lines, now = [], [100.0]
    monkeypatch.setattr(log, "event", lambda name, level=logging.INFO, **f: lines.append((name, f)))
    monkeypatch.setattr(log.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(log, "_sampled", {})
    for i in range(log.SAMPLED_PER_S + 30):  # one second's flood
        log.sampled_event("bad_request", rid=f"r{i}")
    assert [f["rid"] for _, f in lines] == [f"r{i}" for i in range(log.SAMPLED_PER_S)]
    log.sampled_event("other_event", rid="x")  # another event has its own allowance
    assert lines[-1] == ("other_event", {"rid": "x"})
    now[0] += 1.0
    log.sampled_event("bad_request", rid="next")
    assert lines[-2:] == [("bad_request_suppressed", {"count": 30}), ("bad_request", {"rid": "next"})]
    now[0] += 5.0
    log.sampled_event("bad_request", rid="calm")  # nothing held back: no count line
    assert lines[-1] == ("bad_request", {"rid": "calm"}) and lines[-2][0] == "bad_request"


def test_a_held_back_count_is_written_once_its_second_is_over_or_at_stop(monkeypatch):
    """Not only with the next line of its event: a flood that stops would keep it forever."""
    lines, now = [], [100.0]
    monkeypatch.setattr(log, "event", lambda name, level=logging.INFO, **f: lines.append((name, f)))
    monkeypatch.setattr(log.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(log, "_sampled", {})
    for i in range(log.SAMPLED_PER_S + 7):
        log.sampled_event("request_failed", rid=f"r{i}")
    log.flush_sampled()  # the second is not over: nothing yet
    assert len(lines) == log.SAMPLED_PER_S
    now[0] += 1.5
    log.flush_sampled()
    assert lines[-1] == ("request_failed_suppressed", {"count": 7})
    log.flush_sampled()  # written once
    assert len(lines) == log.SAMPLED_PER_S + 1
    for i in range(log.SAMPLED_PER_S + 3):
        log.sampled_event("request_failed", rid=f"s{i}")
    log.flush_sampled(everything=True)  # at stop, the current second's too
    assert lines[-1] == ("request_failed_suppressed", {"count": 3})


def test_a_400_without_mm_items_skips_the_lenient_walk_and_one_with_them_does_not():
    import msgpack

    from mmsched.protocol import owned_segments, unpack_lenient

    text = msgpack.packb({"v": 1, "type": "embed", "rid": "a", "input_ids": "oops"})
    assert unpack_lenient(text) == {"mm_items": []}
    named = msgpack.packb({"v": 9, "mm_items": [{"transport": "shm", "shm_name": "mmsched_x1"}]})
    assert owned_segments(unpack_lenient(named), "mmsched_") == ["mmsched_x1"]


def test_http_aiohttp_cannot_parse_is_one_short_line_whatever_the_client_sent(monkeypatch):
    """An outside attack made aiohttp quote half a megabyte of what it sent in each 400's error:
    the line that stands for it keeps 300 characters of it."""
    from aiohttp.http_exceptions import BadHttpMethod

    lines = []
    monkeypatch.setattr(log, "event", lambda name, level=logging.INFO, **f: lines.append((name, f)))
    monkeypatch.setattr(log, "_sampled", {})
    exc = BadHttpMethod("x" * 500_000)
    record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                               ("127.0.0.1",), (type(exc), exc, None))
    assert log._client_parse_error(record) is False  # not logged as aiohttp's error
    (name, fields), = lines
    assert name == "bad_http_request" and fields["peer"] == "127.0.0.1"
    assert len(fields["error"]) <= 320 and fields["error"].endswith("[truncated]"), len(fields["error"])
