"""The load generator's pure parts: the summary of raw rows, sizes, the spec's bounds, the plot's error."""

from __future__ import annotations

import json
import math
import sys

import pytest

from mmsched.loadgen import LOST, LoadSpec, Records, Report, format_table, parse_size, summarize, write_json, write_plot


def records(rows) -> Records:
    rec = Records()
    for i, (fault, t_send, t_recv, status) in enumerate(rows):
        row = rec.add(f"r{i}", "pooled", fault, -1, 0, t_send)
        if t_recv is not None:
            rec.t_recv[row], rec.status[row] = t_recv, status
    return rec


def test_summary_by_status_lost_and_expected():
    rec = records([("", 0.0, 0.010, 200), ("", 0.1, 0.120, 200), ("fail", 0.2, 0.205, 500),
                   ("bad_name", 0.3, 0.301, 400), ("abort", 0.4, 0.402, 200), ("", 0.5, None, None),
                   ("missing", 0.6, 0.7, 200)])
    s = summarize(rec, elapsed_s=2.0)
    assert (s["sent"], s["completed"], s["lost"]) == (7, 6, 1)
    assert s["achieved_rate"] == 3.0
    assert s["by_status"][200]["count"] == 4 and s["by_status"][500]["count"] == 1
    assert s["by_status"][200]["max_ms"] == pytest.approx(100.0)
    assert s["by_status"][500]["p50_ms"] == pytest.approx(5.0)
    assert s["by_fault"]["none"] == {"200": 2, str(LOST): 1}
    assert s["by_fault"]["abort"] == {"200": 1}  # an abort may lose the race: expected
    assert s["unexpected"] == 1  # the "missing" segment that got a 200
    assert s["send_rate"] == pytest.approx(10.0)


def test_empty_run_summary_is_json_clean(tmp_path):
    rec = records([("", 0.0, None, None)])
    s = summarize(rec, elapsed_s=1.0)
    assert s["lost"] == 1 and math.isnan(s["latency_ms"]["p50"])
    rep = Report({"shm_prefix": "mmsched_"}, s, rec, {"before": 0, "after": 0, "leaked": []})
    assert not rep.ok
    assert "FAIL: lost results" in format_table(rep)
    path = tmp_path / "r.json"
    write_json(rep, str(path))
    doc = json.loads(path.read_text())  # strict JSON: NaN became null
    assert doc["summary"]["latency_ms"]["p50"] is None
    assert doc["raw"]["rows"] == [["r0", "pooled", "", -1, 0, 0.0, None, 0, Records.UNCHECKED]]


def test_a_digest_mismatch_fails_the_report():
    rec = records([("", 0.0, 0.001, 200), ("", 0.1, 0.2, 200), ("fail", 0.2, 0.3, 500)])
    rec.verified[:2] = [Records.MATCHED, Records.MISMATCHED]
    s = summarize(rec)
    assert (s["verified"], s["mismatched"], s["lost"]) == (1, 1, 0)
    rep = Report({"shm_prefix": "mmsched_", "verify": True}, s, rec, {"before": 0, "after": 0, "leaked": []})
    assert not rep.ok
    table = format_table(rep)
    assert "1 results carried exactly the bytes sent, 1 carried other bytes" in table
    assert table.endswith("FAIL: 200s with bytes that were not sent")


def test_leak_fails_the_report():
    rec = records([("", 0.0, 0.001, 200)])
    rep = Report({"shm_prefix": "mmsched_"}, summarize(rec), rec,
                 {"before": 0, "after": 1, "leaked": ["mmsched_1_x"]})
    assert not rep.ok and "leaked segments" in format_table(rep)


def test_results_of_an_unexpected_status_fail_the_report():
    """Outside attack, session 60: 1999 plain requests answered 400 (a server with another
    shm prefix) printed OK and exited 0."""
    rec = records([("", 0.0, 0.001, 200), ("", 0.1, 0.2, 400), ("bad_name", 0.2, 0.3, 400)])
    rep = Report({"shm_prefix": "mmsched_"}, summarize(rec), rec, {"before": 0, "after": 0, "leaked": []})
    assert not rep.ok
    assert format_table(rep).endswith("FAIL: 1 results of a status their kind should not get (see 'by kind')")


@pytest.mark.parametrize("text, n", [("65536", 65536), ("64K", 65536), ("64KiB", 65536), ("1M", 1 << 20),
                                     ("1mib", 1 << 20), ("0.5K", 512), ("2G", 2 << 30)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["0", "-1K", "1.5", "x", ""])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("kw", [dict(rate=10, concurrency=2), dict(rate=0), dict(concurrency=0), dict(requests=0),
                                dict(duration=0), dict(transports=["tcp"]), dict(transports=[]),
                                dict(fail_rate=0.6, client_faults=0.6), dict(abort_rate=-0.1),
                                dict(item_bytes=[]), dict(session_turns=0), dict(type="chat")])
def test_spec_bounds(kw):
    with pytest.raises(ValueError):
        LoadSpec(**kw).validate()


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    rec = records([("", 0.0, 0.001, 200)])
    rep = Report({"shm_prefix": "mmsched_"}, summarize(rec), rec, {"before": 0, "after": 0, "leaked": []})
    with pytest.raises(RuntimeError, match=r"mmsched\[plot\]"):
        write_plot(rep, str(tmp_path / "x.png"))


def test_a_seed_is_a_run_again():
    """The same seed draws the same requests with the same bytes; another seed does not."""
    import random

    from mmsched.loadgen.mix import Mix

    spec = LoadSpec(transports=["pooled", "shm", "inline"], item_bytes=[64, 4096], items=2,
                    fail_rate=0.1, client_faults=0.2, abort_rate=0.1, seed=7)

    def draws(seed):
        mix = Mix(spec, random.Random(seed))
        return [mix.draw() for _ in range(500)], mix.sha256

    first, again, other = draws(7), draws(7), draws(8)
    assert first == again
    assert first[0] != other[0]
    assert {fault for _, fault, _, _ in first[0]} == {"", "fail", "abort", "missing", "too_small", "bad_name"}
