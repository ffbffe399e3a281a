"""Counters each rank keeps, and the leader's Prometheus view of the whole group.

Followers' counters reach the leader in-stream: every couple of seconds the leader
flags a batch, and every rank all-gathers a snapshot of its counters after running it.
The exposition is rendered on scrape from live state (prometheus_client custom
collector), so nothing is counted twice.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


@dataclass
class RankCounters:
    """What one rank counts on its lane; snapshots travel to the leader."""

    failures: Counter = field(default_factory=Counter)  # stage -> requests failed here
    release_failures: int = 0
    segments_unlinked: int = 0
    bytes_forwarded: int = 0  # leader: feature bytes shipped to ranks on other hosts

    def snapshot(self) -> dict:
        return {"failures": dict(self.failures), "release_failures": self.release_failures,
                "segments_unlinked": self.segments_unlinked,
                "bytes_forwarded": self.bytes_forwarded}


class Metrics:
    LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
    CONSENSUS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1, 10)

    def __init__(self, status):
        """``status``: the leader's narrow view (``rank.status.Status``), read on each scrape."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.consensus_seconds = Histogram(
            "mmsched_consensus_seconds", "Time of one batch's failure agreement (one collective)",
            buckets=self.CONSENSUS_BUCKETS, registry=self.registry)
        self.request_latency = _Latencies(
            "mmsched_request_latency_seconds", "From admission at the leader to the result being sent",
            self.LATENCY_BUCKETS)
        self.observe_latency = self.request_latency.observe
        self.registry.register(self.request_latency)
        self.registry.register(_GroupCollector(status))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Latencies:
    """A histogram of result latencies by status, counted in plain lists and rendered on scrape.

    Why not prometheus_client's ``Histogram``: its ``observe`` takes a lock for the bucket and
    another for the sum, for every result: 5% of the leader's time holding the GIL at tp=2
    (py-spy ``--gil``, plain synchronous client). Only the loop thread observes, and the
    scrape runs on that loop too, so nothing here needs a lock."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, bounds
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self._by_status: dict[int, list] = {}  # status -> [count per bucket, +Inf's last; then the sum]

    def observe(self, status: int, seconds: float) -> None:
        row = self._by_status.get(status)
        if row is None:
            row = self._by_status[status] = [0] * len(self._les) + [0.0]
        row[bisect_left(self.bounds, seconds)] += 1  # the first bound >= seconds: buckets are "le"
        row[-1] += seconds

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["status"])
        for status, row in sorted(self._by_status.items()):
            total, buckets = 0, []
            for le, n in zip(self._les, row):
                total += n
                buckets.append((le, total))
            family.add_metric([str(status)], buckets, sum_value=row[-1])
        yield family


class _GroupCollector:
    def __init__(self, status):
        self.status = status

    def collect(self):
        st = self.status
        results = CounterMetricFamily("mmsched_results", "Results sent, by status", labels=["status"])
        for status, n in sorted(st.results_sent.items()):
            results.add_metric([str(status)], n)
        yield results
        yield GaugeMetricFamily("mmsched_requests_waiting", "Requests queued at the leader", value=st.queued)
        yield GaugeMetricFamily("mmsched_requests_running", "Requests in the batches started on the ranks (up to two at tp > 1)",
                                value=st.running)
        yield GaugeMetricFamily("mmsched_feature_bytes_inflight", "Feature bytes of queued and running requests",
                                value=st.feature_bytes_held)
        per_rank = st.rank_counters()
        fails = CounterMetricFamily("mmsched_materialize_failures",
                                    "Requests a rank failed, by rank and stage", labels=["rank", "stage"])
        rel = CounterMetricFamily("mmsched_release_failures", "Close/unlink failures, by rank", labels=["rank"])
        for rank, snap in sorted(per_rank.items()):
            for stage, n in sorted(snap["failures"].items()):
                fails.add_metric([str(rank), stage], n)
            rel.add_metric([str(rank)], snap["release_failures"])
        yield fails
        yield rel
        yield CounterMetricFamily("mmsched_segments_unlinked", "Shared-memory segments unlinked by the leader",
                                  value=per_rank.get(0, {}).get("segments_unlinked", 0) + st.unlinked_at_leader)
        yield CounterMetricFamily("mmsched_feature_bytes_forwarded", "Feature bytes the leader sent to other hosts",
                                  value=per_rank.get(0, {}).get("bytes_forwarded", 0))
        yield CounterMetricFamily("mmsched_orphans_reclaimed", "Orphaned segments removed by the sweep",
                                  value=st.orphans_reclaimed)
        yield GaugeMetricFamily("mmsched_session_bytes", "Feature bytes held by sessions",
                                value=st.sessions.nbytes)
        yield GaugeMetricFamily("mmsched_sessions", "Open sessions", value=len(st.sessions))
        yield GaugeMetricFamily("mmsched_session_features", "Features held by sessions",
                                value=st.sessions.features)
        if st.connections is not None:
            yield GaugeMetricFamily("mmsched_client_connections", "Client connections open at the frontend",
                                    value=len(st.connections.open))
            yield GaugeMetricFamily("mmsched_client_connections_at_most",
                                    "Client connections kept open at most (what RLIMIT_NOFILE leaves)",
                                    value=st.connections.at_most)
            yield GaugeMetricFamily("mmsched_client_connections_door_shut",
                                    "1 while new connections wait outside (the bound is full)",
                                    value=int(st.connections.paused))
            yield CounterMetricFamily("mmsched_client_connections_refused",
                                      "Connections shut down as accepted: at_most were open",
                                      value=st.connections.refused)
        yield GaugeMetricFamily("mmsched_ranks", "Ranks in the group", value=st.world)
        yield GaugeMetricFamily("mmsched_healthy", "1 while /health would answer 200", value=int(st.health()[0]))
