"""The latency histogram is counted in plain lists (prometheus_client's takes two locks per
result); a scrape must still read what prometheus_client's own Histogram would have given."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmsched.metrics import Metrics, _Latencies

NAME = "mmsched_request_latency_seconds"


def samples(text: bytes) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, for the latency histogram's bucket, count and sum."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name.startswith(NAME) and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_latency_histogram_reads_as_prometheus_clients_own():
    rng = random.Random(13)
    bounds = Metrics.LATENCY_BUCKETS
    # on every bound, just either side of it, past the last one, and anywhere between
    values = [b + d for b in bounds for d in (-1e-9, 0.0, 1e-9)] + [0.0, 31.0, 1e6]
    values += [rng.uniform(0, 40) for _ in range(300)] + [rng.uniform(0, 0.01) for _ in range(300)]
    ours = _Latencies(NAME, "doc", bounds)
    theirs = Histogram(NAME, "doc", ["status"], buckets=bounds, registry=(registry := CollectorRegistry()))
    for i, v in enumerate(values):
        status = (200, 500, 503)[i % 3]
        ours.observe(status, v)
        theirs.labels(str(status)).observe(v)
    mine = CollectorRegistry()
    mine.register(ours)
    got, want = samples(generate_latest(mine)), samples(generate_latest(registry))
    assert got.keys() == want.keys() and len(got) == 3 * (len(bounds) + 1 + 2)
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key
    assert got[(f"{NAME}_count", (("status", "500"),))] == len(values[1::3])


def test_a_status_never_seen_has_no_series():
    ours = _Latencies(NAME, "doc", Metrics.LATENCY_BUCKETS)
    registry = CollectorRegistry()
    registry.register(ours)
    assert samples(generate_latest(registry)) == {}
    ours.observe(200, 0.002)
    assert samples(generate_latest(registry))[(f"{NAME}_bucket", (("le", "0.0025"), ("status", "200")))] == 1
