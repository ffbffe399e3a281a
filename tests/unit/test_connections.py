"""The frontend's bound on client connections (rank/connections.py), on a real ROUTER:
connections past ``at_most`` are shut down as they are accepted, the ones kept are served,
and room comes back as clients leave."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import zmq

from mmsched.rank.connections import ConnectionBound


def until(check, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    return check()


@pytest.fixture(params=["ipc", "tcp"])
def router(request, tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    bound = ConnectionBound(ctx, sock, at_most=3)
    addr = f"ipc://{tmp_path}/f-{uuid.uuid4().hex[:6]}.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"
    sock.bind(addr)
    addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    clients = zmq.Context()
    yield sock, bound, addr, clients
    clients.destroy(linger=0)
    bound.close()
    ctx.destroy(linger=0)


def echo_all(sock, bound, timeout: float) -> set[bytes]:
    """What the ROUTER reads within ``timeout``, each message echoed to its sender; the
    bound's events drained as they come."""
    seen, deadline = set(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        bound.drain()
        if sock.poll(20):
            frames = sock.recv_multipart()
            sock.send_multipart(frames)
            seen.add(frames[1])
    return seen


def test_connections_past_the_bound_are_shut_down_and_room_comes_back(router):
    sock, bound, addr, clients = router
    dealers = []
    for i in range(5):
        d = clients.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(addr)
        dealers.append(d)
    assert until(lambda: (bound.drain(), bound.refused >= 2)[1]), (bound.open, bound.refused)
    time.sleep(0.5)  # refused clients reconnect (every 100 ms) and are refused again
    bound.drain()
    assert len(bound.open) == 3, bound.open
    open_fds = set(bound.open)
    assert all(os.path.exists(f"/proc/self/fd/{fd}") for fd in open_fds)
    for i, d in enumerate(dealers):
        d.send(b"hello-%d" % i)
    answered = echo_all(sock, bound, 1.0)
    got = {i for i, d in enumerate(dealers) if d.poll(500) and d.recv() == b"hello-%d" % i}
    assert len(got) >= 3, f"only {sorted(got)} of 5 were answered (3 connections are kept)"
    assert bound.open == open_fds, "a kept connection was shut down"
    kept = [d for i, d in enumerate(dealers) if i in got][:3]
    for d in kept:  # those that leave make room: the refused ones get in on their next try
        d.close(linger=0)
    rest = [d for d in dealers if d not in kept]
    assert until(lambda: (bound.drain(), len(bound.open) == len(rest))[1]), bound.open
    for i, d in enumerate(rest):
        d.send(b"again-%d" % i)
    echo_all(sock, bound, 1.0)
    assert all(d.poll(2000) for d in rest), "a client refused before was not served once there was room"
    for d in rest:
        d.close(linger=0)
    assert until(lambda: (bound.drain(), not bound.open)[1]), f"{bound.open} still counted after every client left"
    assert answered  # the loop read the kept connections' messages
