"""The bytes mmsched answers with, pinned: a result, a pong and an ack encode exactly as
main's dict builders encoded them before the typed messages (computed from main's
protocol.py, then written down here). A change in a field's name, order or type shows here
before any client notices."""

from __future__ import annotations

import msgpack
import pytest

from mmsched.protocol import AckClose, Batch, Item, Pong, Request, Result, ack_close, pack, pong, result

PINNED = [
    (Result("r1", 200, output={"embedding": [1.5, 2]}, meta={"ranks": 2}),
     "88a17601a474797065a6726573756c74a3726964a27231a6737461747573ccc8a86572725f74797065c0a76d657373616765c0a6"
     "6f757470757481a9656d62656464696e6792cb3ff800000000000002a46d65746181a572616e6b7302"),
    (Result("r2", 500, message="boom", meta={"failed_ranks": [1], "stage": "materialize"}),
     "88a17601a474797065a6726573756c74a3726964a27232a6737461747573cd01f4a86572725f74797065b3496e7465726e616c5365"
     "727665724572726f72a76d657373616765a4626f6f6da66f7574707574c0a46d65746182ac6661696c65645f72616e6b739101a573"
     "74616765ab6d6174657269616c697a65"),
    (Result(None, 400, message="header: could not be decoded"),
     "88a17601a474797065a6726573756c74a3726964c0a6737461747573cd0190a86572725f74797065af42616452657175657374"
     "4572726f72a76d657373616765bc6865616465723a20636f756c64206e6f74206265206465636f646564a66f7574707574c0a4"
     "6d65746180"),
    (Pong(2, True, {"state": "serving", "hosts": {"host0": [0, 1]}}),
     "86a17601a474797065a4706f6e67a572616e6b7302a76865616c746879c3a57374617465a773657276696e67a5686f73747381a5"
     "686f737430920001"),
    (AckClose("s1"), "84a17601a474797065a361636ba26f70ad636c6f73655f73657373696f6eaa73657373696f6e5f6964a27331"),
]


@pytest.mark.parametrize("message,wire", PINNED, ids=["result-200", "result-500", "result-400", "pong", "ack"])
def test_outgoing_messages_encode_to_the_pinned_bytes(message, wire):
    assert pack(message.to_wire()).hex() == wire


def test_the_dict_builders_give_the_same_bytes_as_the_typed_messages():
    built = [result("r1", 200, None, {"embedding": [1.5, 2]}, {"ranks": 2}),
             result("r2", 500, "boom", meta={"failed_ranks": [1], "stage": "materialize"}),
             result(None, 400, "header: could not be decoded"),
             pong(2, True, state="serving", hosts={"host0": [0, 1]}), ack_close("s1")]
    assert [pack(h).hex() for h in built] == [wire for _, wire in PINNED]


def test_a_result_reads_back_as_it_was_sent():
    sent = Result("r2", 500, message="boom", meta={"failed_ranks": [1]})
    back = Result.from_wire(msgpack.unpackb(pack(sent.to_wire())))
    assert back == Result("r2", 500, "InternalServerError", "boom", None, {"failed_ranks": [1]})
    assert not back.ok and Result.from_wire({"rid": "r", "status": 200}).ok


def test_a_batch_round_trips_with_its_inline_payload():
    import numpy as np

    item = Item(index=0, modality="image", transport="inline", dtype="float16", shape=(2, 3), nbytes=12,
                payload=memoryview(bytes(range(12))), id="img")
    req = Request("r", "embed", np.arange(4, dtype="<i4"), [item], session_id="s", want_digest=True)
    back = Batch.decode(Batch(7, [req], closes=["old"], gather_stats=True).encode())
    assert (back.seq, back.closes, back.gather_stats, back.stop) == (7, ["old"], True, False)
    got = back.requests[0]
    assert got.input_ids.tolist() == [0, 1, 2, 3] and got.session_id == "s" and got.want_digest
    assert bytes(got.items[0].payload) == bytes(range(12)) and got.items[0].nbytes == 12
    assert msgpack.unpackb(Batch(1).encode()) == [1, False, [], [], False]


def test_a_batch_with_big_inline_payloads_encodes_to_packbs_bytes_and_back():
    """Big payloads are joined rather than packed (the leader's encode at tp=2): the bytes must
    be exactly ``packb``'s, whatever mix of sizes, buffer types, sessions and params."""
    import numpy as np

    from mmsched.protocol.batch import BIG_PAYLOAD

    rng = np.random.default_rng(5)
    sizes = [0, 7, BIG_PAYLOAD - 1, BIG_PAYLOAD, BIG_PAYLOAD + 3, 3 << 20]
    reqs = []
    for k in range(12):
        items = []
        for j in range(int(rng.integers(0, 4))):
            n = int(rng.choice(sizes))
            raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            payload = memoryview(raw) if j % 2 else bytearray(raw)
            items.append(Item(index=j, modality="image", transport="inline", dtype="uint8", shape=(n,), nbytes=n,
                              payload=payload, id=f"i{j}" if k % 3 == 0 else None))
        items.append(Item(index=len(items), modality="audio", transport="shm", dtype="float32", shape=(4,),
                          nbytes=16, shm_name=f"mmsched_s{k}"))
        reqs.append(Request(f"r{k}", "embed", np.arange(k + 1, dtype="<i4"), items, session_id="s" if k % 2 else None,
                            params={"temperature": 0.5, "nested": {"k": [1, 2, b"x" * k]}}))
    batch = Batch(9, reqs, closes=["gone"], gather_stats=True)
    packed = msgpack.packb([9, False, [r.wire() for r in reqs], ["gone"], True], use_bin_type=True)
    assert any(it.nbytes >= BIG_PAYLOAD for r in reqs for it in r.items), "the joined path ran"
    assert batch.encode() == packed
    back = Batch.decode(batch.encode())
    for sent, got in zip(reqs, back.requests):
        assert [bytes(it.payload) if it.payload is not None else None for it in got.items] == \
               [bytes(it.payload) if it.payload is not None else None for it in sent.items]
