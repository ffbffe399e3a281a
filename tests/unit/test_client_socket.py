"""The client's socket without zmq.asyncio: what ZeroMQ cannot take yet goes out later, in
order; a message given up is never sent; replies are read however sends and reads interleave."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import zmq

from mmsched.client_socket import ClientSocket
from tests.integration.lifecycle import until


@contextlib.contextmanager
def _echo_thread(addr: str, got: list | None = None):
    """A ROUTER on its own thread (replies arrive while the client's loop is busy) answering
    each message with its parts joined in one frame, and recording them in ``got``. One-frame
    replies: libzmq can abort a reader whose peer closes inside a multipart message (its
    fq.cpp assertion)."""
    stop = threading.Event()

    def echo():
        r = zmq.Context.instance().socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.bind(addr)
        while not stop.is_set():
            if r.poll(10, zmq.POLLIN):
                ident, *body = r.recv_multipart()
                if got is not None:
                    got.append(body)
                r.send_multipart([ident, b"|".join(body)])
        r.close(0)
    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def _dealer(addr: str, sndhwm: int = 1000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, sndhwm)
    s.setsockopt(zmq.IMMEDIATE, 1)  # no peer, no queue: every send waits for the server
    s.connect(addr)
    return s


@contextlib.asynccontextmanager
async def _reading(addr: str, handle):
    """A ClientSocket on a DEALER to ``addr`` with its reader running, torn down after."""
    sock = _dealer(addr)
    io = ClientSocket(sock)
    reader = asyncio.ensure_future(io.receive(handle))
    try:
        yield io
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        io.close()
        sock.close(0)


async def test_what_waits_for_a_server_goes_out_in_order_once_it_is_there(tmp_path):
    replies: list = []
    async with _reading(f"ipc://{tmp_path}/late", lambda frames, at: replies.append((frames, at))) as io:
        tracked = [io.send([b"m%d" % i, b"part2"], track=i % 2 == 0) for i in range(50)]
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in tracked if t is not None), "sent with no server to take it"
        got: list = []
        with _echo_thread(f"ipc://{tmp_path}/late", got):
            await until(lambda: len(replies) == 50, "the 50 replies", timeout=10)
        assert got == [[b"m%d" % i, b"part2"] for i in range(50)]
        assert all(t.done() and not t.cancelled() for t in tracked if t is not None)
        assert [f for f, _ in replies] == [[b"m%d|part2" % i] for i in range(50)]
        assert all(at <= time.perf_counter() for _, at in replies)


async def test_a_message_given_up_is_never_sent(tmp_path):
    addr = f"ipc://{tmp_path}/dropped"
    replies: list = []
    async with _reading(addr, lambda frames, at: replies.append(frames)) as io:
        first = io.send([b"given up"], track=True)
        io.send([b"kept"])
        first.cancel()
        assert first.cancelled()
        got: list = []
        with _echo_thread(addr, got):
            await until(lambda: len(replies) == 1, "the one reply", timeout=10)
        assert got == [[b"kept"]] and replies == [[b"kept"]]


async def test_a_tracked_message_whose_sender_timed_out_is_never_sent(tmp_path):
    """As ``ping`` waits: ``await sent`` under a deadline cancels ``sent`` when it passes, and
    the message must not go out later (the review of session 60 found it sent after all)."""
    addr = f"ipc://{tmp_path}/timed_out"
    replies: list = []
    async with _reading(addr, lambda frames, at: replies.append(frames)) as io:
        sent = io.send([b"too late"], track=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sent, 0.05)
        io.send([b"kept"])
        got: list = []
        with _echo_thread(addr, got):
            await until(lambda: len(replies) == 1, "the one reply", timeout=10)
        assert got == [[b"kept"]] and replies == [[b"kept"]]


async def test_a_closed_loop_of_sends_from_reply_callbacks_is_all_answered(tmp_path):
    """Each reply sends the next request from inside the reader's callback, as the load
    generator's closed loop does: 5000 requests, 64 in flight, every one answered."""
    addr = f"ipc://{tmp_path}/loop"
    total, done = 5000, asyncio.get_running_loop().create_future()
    state = {"sent": 0, "answered": 0}
    io: list[ClientSocket] = []

    def send_next():
        io[0].send([b"%d" % state["sent"]])
        state["sent"] += 1

    def on_reply(frames, at):
        state["answered"] += 1
        if state["sent"] < total:
            send_next()
        elif state["answered"] == total and not done.done():
            done.set_result(None)

    with _echo_thread(addr):
        async with _reading(addr, on_reply) as client:
            io.append(client)
            for _ in range(64):
                send_next()
            await asyncio.wait_for(done, 30)
    assert state == {"sent": total, "answered": total}


async def test_a_reply_whose_wake_up_a_send_took_is_still_read(tmp_path):
    """A send takes in the socket's pending commands (libzmq does so at most every ~1 ms),
    among them the one saying a reply arrived, and with it the descriptor's wake-up: after
    that, nothing wakes a reader that does not look at ZMQ_EVENTS again. Made to happen
    here: the loop is kept busy while a reply arrives, then a send comes first."""
    addr = f"ipc://{tmp_path}/edge"
    replies: list = []
    with _echo_thread(addr):
        async with _reading(addr, lambda frames, at: replies.append(frames)) as io:
            for k in range(5):
                await asyncio.sleep(0.02)  # the reader has read everything and waits
                io.send([b"a%d" % k])
                time.sleep(0.05)  # the loop busy: the reply arrives, its wake-up waits in the descriptor
                io.send([b"b%d" % k])  # the first send in 50 ms: it takes in the commands
                for _ in range(200):
                    if len(replies) == 2 * (k + 1):
                        break
                    await asyncio.sleep(0.01)
                assert replies[-2:] == [[b"a%d" % k], [b"b%d" % k]], f"round {k}: read {replies}"


async def test_replies_are_read_while_another_task_keeps_sending(tmp_path):
    """An open loop as the load generator sends (bursts of 20, a millisecond apart) while
    replies arrive from another thread: 4000 sent, each read once."""
    addr = f"ipc://{tmp_path}/open"
    total, replies = 4000, []
    done = asyncio.get_running_loop().create_future()

    def on_reply(frames, at):
        replies.append(frames)
        if len(replies) == total and not done.done():
            done.set_result(None)

    with _echo_thread(addr):
        async with _reading(addr, on_reply) as io:
            for i in range(total):
                io.send([b"%d" % i])
                if i % 20 == 19:
                    await asyncio.sleep(0.001)
            await asyncio.wait_for(done, 20)
    assert sorted(int(f[0]) for f in replies) == list(range(total))
