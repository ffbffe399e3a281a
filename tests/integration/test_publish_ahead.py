"""The leader publishes the batches queued behind a step once that step's agreement is in,
so its follower starts the next batch while the leader still renders the last: two real
rank processes, a gloo group with the same-host ring, ``BatchRunner`` and the reference
engine, the leader's ``Publisher`` as the leader uses it."""

from __future__ import annotations

import os
import time

from ..conftest import two_ranks

RENDER_S = 0.5  # the leader's rendering of the first batch, slowed: the follower must not wait for it
BIG = 1 << 20  # an inline feature bigger than the whole ring (8 slots of 64 KiB)


def _rank(rank: int, port: int, out, ahead: bool, big: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import msgpack

    from mmsched.batch import BatchRunner
    from mmsched.config import Config
    from mmsched.faults import NO_FAULTS
    from mmsched.group import GlooGroup, RingGroup
    from mmsched.protocol import Item, decode
    from mmsched.protocol.batch import Batch
    from mmsched.rank.publisher import Publisher
    from mmsched.server import start_engine
    from mmsched.sessions import SessionStore

    cfg = Config(shm_prefix="mmtest_")
    timeout_s = 8.0 if big else 60.0
    group = RingGroup(GlooGroup(rank, 2, "env://", timeout_s), ["h", "h"], cfg.shm_prefix, timeout_s)
    engine, gather = start_engine(cfg, group)
    runner = BatchRunner(group, engine, NO_FAULTS, unlinks=rank == 0, sessions=SessionStore(1 << 20, 16, 16),
                         gather=gather)
    report = {"can_go_ahead": group.publishes_ahead}
    if rank == 0:
        published = []

        class Recording:  # the group, each batch it publishes recorded
            publishes_ahead = group.publishes_ahead

            def broadcast(self, payload):
                published.append(Batch.decode(payload).seq)
                return group.broadcast(payload)

            def broadcast_if_room(self, payload):
                went = group.broadcast_if_room(payload)
                if went:
                    published.append(Batch.decode(payload).seq)
                return went

        publisher = Publisher(Recording())
        if ahead:
            runner.agreed = publisher.ahead
        render = runner._results

        def slow_render(reqs, outcomes, world):
            if reqs[0].rid == "first":
                time.sleep(RENDER_S)
            return render(reqs, outcomes, world)

        runner._results = slow_render
        ids = b"".join(i.to_bytes(4, "little") for i in range(16))
        req = lambda rid: decode([msgpack.packb({"v": 1, "type": "generate", "rid": rid, "input_ids": ids,  # noqa: E731
                                                 "max_new_tokens": 3}, use_bin_type=True)], cfg.limits)
        first, second = Batch(1, [req("first")]), Batch(2, [req("second")])
        if big:  # the first batch ends in a counters' exchange; the second cannot fit in the ring
            first.gather_stats = True
            second.requests[0].items = [Item(index=0, modality="image", transport="inline", dtype="uint8",
                                             shape=(BIG,), nbytes=BIG, payload=bytes(BIG))]
        publisher.started(first)
        publisher.started(second)  # both on the lane, as the leader's loop queues them
        results = []
        for batch in (first, second):
            publisher.through(batch)
            results += runner.run(batch)[0]
            if batch.gather_stats:
                runner.exchange_counters()
            report[f"done_{batch.seq}"] = time.monotonic()
        group.broadcast(Batch(3, [], stop=True).encode())
        report.update(published=published, results=[(r["status"], r["output"]) for r in results])
    else:
        read = []
        while not (batch := Batch.decode(group.broadcast(None))).stop:
            read.append((batch.seq, time.monotonic()))
            runner.run(batch)
            if batch.gather_stats:
                runner.exchange_counters()
        report["read"] = read
    out.put((rank, report))
    group.close()


def _run(ahead: bool, big: bool = False) -> dict:
    return dict(two_ranks(_rank, ahead, big))


def test_the_follower_starts_the_next_batch_while_the_leader_renders_the_last():
    leader, follower = (early := _run(ahead=True))[0], early[1]
    assert leader["can_go_ahead"] and leader["published"] == [1, 2], "each batch published once, in order"
    assert [seq for seq, _ in follower["read"]] == [1, 2]
    read_second = follower["read"][1][1]
    assert read_second < leader["done_1"] - RENDER_S / 2, "the follower had the next batch before the leader rendered"
    late = _run(ahead=False)  # published when the leader runs it: the follower waits for the render
    assert late[1]["read"][1][1] > late[0]["done_1"] - 0.05
    assert leader["results"] == late[0]["results"] and [s for s, _ in leader["results"]] == [200, 200]


def test_a_batch_the_ring_has_no_room_for_waits_for_its_turn_instead_of_hanging_the_group():
    """Found by an outside attack (aborts and big features under load broke the group): the
    follower, done with the first batch, waits for the leader in the counters' exchange; a
    publish ahead that waited for ring space (the follower reading) never ended."""
    leader, follower = (got := _run(ahead=True, big=True))[0], got[1]
    assert [seq for seq, _ in follower["read"]] == [1, 2] and leader["published"] == [1, 2]
    assert [s for s, _ in leader["results"]] == [200, 200]
