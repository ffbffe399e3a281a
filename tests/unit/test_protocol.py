"""The wire contract's validation, without I/O: every malformed field is a BadRequest naming it."""

from __future__ import annotations

import copy

import msgpack
import numpy as np
import pytest

from mmsched.errors import BadRequest
from mmsched.protocol import (SMALL_HEADER, Abort, CloseSession, Limits, Ping, Request, decode, owned_segments,
                              unpack_header, unpack_lenient, valid_shm_name)

LIMITS = Limits()
PREFIX = LIMITS.shm_prefix


def pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def base(**over) -> dict:
    """A valid embed request with one shm and one inline item (frame 1 holds 2x3 float32)."""
    h = {
        "v": 1, "type": "embed", "rid": "r-1", "input_ids": [1, 2, 3],
        "mm_items": [
            {"modality": "image", "transport": "shm", "dtype": "float32", "shape": [2, 3],
             "shm_name": PREFIX + "abc"},
            {"modality": "audio", "transport": "inline", "dtype": "float32", "shape": [2, 3], "frame": 1},
        ],
    }
    h.update(over)
    return h


PAYLOAD = bytes(24)


def frames_of(header, *payloads) -> list:
    return [pack(header), *(payloads or (PAYLOAD,))]


def bad(header, *payloads, limits: Limits = LIMITS) -> BadRequest:
    with pytest.raises(BadRequest) as ei:
        decode(frames_of(header, *payloads), limits)
    return ei.value


def with_item(i: int, **over) -> dict:
    h = base()
    h["mm_items"][i].update(over)
    return h


def without_item_key(i: int, key: str) -> dict:
    h = base()
    del h["mm_items"][i][key]
    return h


def without(key: str) -> dict:
    h = base()
    del h[key]
    return h


# ---------------------------------------------------------------- the valid baseline

def test_valid_request_decodes():
    req = decode(frames_of(base()), LIMITS)
    assert isinstance(req, Request)
    assert req.rid == "r-1" and req.type == "embed"
    assert req.input_ids.tolist() == [1, 2, 3] and req.input_ids.dtype == np.dtype("<i4")
    assert [it.transport for it in req.items] == ["shm", "inline"]
    assert req.items[0].nbytes == 24 and req.items[0].offset == 0 and req.items[0].pooled is False
    assert bytes(req.items[1].payload) == PAYLOAD
    assert req.max_new_tokens == LIMITS.default_max_new_tokens
    assert req.owned_segments == [PREFIX + "abc"]


def test_input_ids_as_int32_bin():
    ids = np.array([5, 0, 2**31 - 1], dtype="<i4")
    req = decode(frames_of(base(input_ids=ids.tobytes())), LIMITS)
    assert req.input_ids.tolist() == [5, 0, 2**31 - 1]


def test_generate_params_and_other_messages():
    req = decode(frames_of(base(type="generate", params={"max_new_tokens": 3}, want_digest=True)), LIMITS)
    assert req.type == "generate" and req.max_new_tokens == 3 and req.want_digest is True
    assert isinstance(decode([pack({"v": 1, "type": "ping"})], LIMITS), Ping)
    ab = decode([pack({"v": 1, "type": "abort", "rid": "x"})], LIMITS)
    assert isinstance(ab, Abort) and ab.rid == "x"
    cs = decode([pack({"v": 1, "type": "close_session", "session_id": "s"})], LIMITS)
    assert isinstance(cs, CloseSession) and cs.session_id == "s"


def test_shape_edges_accepted():
    h = with_item(0, shape=[0, 3])
    assert decode(frames_of(h), LIMITS).items[0].nbytes == 0
    h = with_item(0, shape=[1] * 8)
    assert decode(frames_of(h), LIMITS).items[0].shape == (1,) * 8


def test_a_zero_size_item_may_have_any_dimension_a_tensor_can():
    """Outside attacks: [0, 2**64-1], then [2**62, 4, 0], passed and were a 500 carrying
    torch's overflow text on every rank. Its dimensions, zeros left out, must multiply below
    2**63 (torch's sizes and strides are int64); the largest such shapes still materialize."""
    import torch

    from mmsched.transport.base import typed

    for shape in ([0, 2**63 - 1], [2**31, 0, 2**32 - 1]):
        item = decode(frames_of(with_item(0, shape=shape)), LIMITS).items[0]
        assert typed(torch.empty(0, dtype=torch.uint8), item).shape == tuple(shape)
    for shape in ([0, 2**63], [2**64 - 1, 0], [2**62, 4, 0], [2**32, 2**32, 0], [0, 2**63 - 1, 2**63 - 1]):
        with pytest.raises(BadRequest, match=r"mm_items\[0\]\.shape: its dimensions.*less than 2\*\*63"):
            decode(frames_of(with_item(0, shape=shape)), LIMITS)


def test_rid_of_128_chars_accepted():
    assert decode(frames_of(base(rid="r" * 128)), LIMITS).rid == "r" * 128


# ---------------------------------------------------------------- one field at a time

CASES = {
    # header level
    "v missing": (without("v"), "v"),
    "v 2": (base(v=2), "v"),
    "v str": (base(v="1"), "v"),
    "v true": (base(v=True), "v"),
    "v float": (base(v=1.0), "v"),
    "type missing": (without("type"), "type"),
    "type unknown": (base(type="embedd"), "type"),
    "type int": (base(type=3), "type"),
    "type list": (base(type=["embed"]), "type"),
    "type map": (base(type={"a": 1}), "type"),
    "rid missing": (without("rid"), "rid"),
    "rid empty": (base(rid=""), "rid"),
    "rid 129 chars": (base(rid="r" * 129), "rid"),
    "rid int": (base(rid=7), "rid"),
    "rid bin": (base(rid=b"r-1"), "rid"),
    "input_ids missing": (without("input_ids"), "input_ids"),
    "input_ids empty list": (base(input_ids=[]), "input_ids"),
    "input_ids empty bin": (base(input_ids=b""), "input_ids"),
    "input_ids str": (base(input_ids="1 2 3"), "input_ids"),
    "input_ids map": (base(input_ids={"a": 1}), "input_ids"),
    "input_ids floats": (base(input_ids=[1.0, 2.0]), "input_ids"),
    "input_ids bools": (base(input_ids=[True, False]), "input_ids"),
    "input_ids nested": (base(input_ids=[[1], [2]]), "input_ids"),
    "input_ids ragged": (base(input_ids=[1, [2]]), "input_ids"),
    "input_ids mixed sign 64-bit": (base(input_ids=[-1, 2**64 - 1]), "input_ids"),
    "input_ids str elements": (base(input_ids=["1"]), "input_ids"),
    "input_ids nil elements": (base(input_ids=[1, None]), "input_ids"),
    "input_ids negative": (base(input_ids=[1, -1]), "input_ids"),
    "input_ids 2^31": (base(input_ids=[2**31]), "input_ids"),
    "input_ids 2^63": (base(input_ids=[2**63]), "input_ids"),
    "input_ids bin 5 bytes": (base(input_ids=b"\x01\x00\x00\x00\x02"), "input_ids"),
    "input_ids bin negative": (base(input_ids=np.array([-3], "<i4").tobytes()), "input_ids"),
    "input_ids bin negative among valid": (base(input_ids=np.array([5, 2**31 - 1, 0, -2**31, 9], "<i4").tobytes()), "input_ids"),
    "params not map": (base(params=[1]), "params"),
    "max_new_tokens 0": (base(type="generate", params={"max_new_tokens": 0}), "params.max_new_tokens"),
    "max_new_tokens -1": (base(type="generate", params={"max_new_tokens": -1}), "params.max_new_tokens"),
    "max_new_tokens float": (base(type="generate", params={"max_new_tokens": 2.0}), "params.max_new_tokens"),
    "max_new_tokens str": (base(type="generate", params={"max_new_tokens": "8"}), "params.max_new_tokens"),
    "max_new_tokens bool": (base(type="generate", params={"max_new_tokens": True}), "params.max_new_tokens"),
    "max_new_tokens too big": (base(type="generate", params={"max_new_tokens": 10**9}), "params.max_new_tokens"),
    "want_digest int": (base(want_digest=1), "want_digest"),
    "want_digest str": (base(want_digest="yes"), "want_digest"),
    "session_id int": (base(session_id=5), "session_id"),
    "session_id empty": (base(session_id=""), "session_id"),
    "mm_items map": (base(mm_items={"modality": "image"}), "mm_items"),
    "mm_items str": (base(mm_items="x"), "mm_items"),
    "item not a map": (base(mm_items=[["shm"]]), "mm_items[0]"),
    "item int": (base(mm_items=[base()["mm_items"][0], 5]), "mm_items[1]"),
    # item fields (item 1 is inline, item 0 shm: the index must be the failing item's)
    "transport missing": (without_item_key(1, "transport"), "mm_items[1].transport"),
    "transport unknown": (with_item(1, transport="tcp"), "mm_items[1].transport"),
    "transport list": (with_item(1, transport=["shm"]), "mm_items[1].transport"),
    "modality missing": (without_item_key(0, "modality"), "mm_items[0].modality"),
    "modality unknown": (with_item(0, modality="smell"), "mm_items[0].modality"),
    "modality map": (with_item(0, modality={"a": 1}), "mm_items[0].modality"),
    "dtype missing": (without_item_key(1, "dtype"), "mm_items[1].dtype"),
    "dtype unknown": (with_item(1, dtype="complex64"), "mm_items[1].dtype"),
    "dtype torch style": (with_item(1, dtype="torch.float32"), "mm_items[1].dtype"),
    "dtype list": (with_item(1, dtype=["float32"]), "mm_items[1].dtype"),
    "shape missing": (without_item_key(0, "shape"), "mm_items[0].shape"),
    "shape 0 dims": (with_item(0, shape=[]), "mm_items[0].shape"),
    "shape 9 dims": (with_item(0, shape=[1] * 9), "mm_items[0].shape"),
    "shape negative": (with_item(0, shape=[2, -3]), "mm_items[0].shape"),
    "shape float": (with_item(0, shape=[2, 3.0]), "mm_items[0].shape"),
    "shape str dim": (with_item(0, shape=[2, "3"]), "mm_items[0].shape"),
    "shape bool dim": (with_item(0, shape=[True, 3]), "mm_items[0].shape"),
    "shape int": (with_item(0, shape=6), "mm_items[0].shape"),
    "shape too many bytes": (with_item(0, shape=[2**40, 2**40]), "mm_items[0].shape"),
    "shm_name missing": (without_item_key(0, "shm_name"), "mm_items[0].shm_name"),
    "shm_name no prefix": (with_item(0, shm_name="psm_abc"), "mm_items[0].shm_name"),
    "shm_name leading slash": (with_item(0, shm_name="/" + PREFIX + "abc"), "mm_items[0].shm_name"),
    "shm_name path": (with_item(0, shm_name=PREFIX + "x/../../etc/passwd"), "mm_items[0].shm_name"),
    "shm_name dotdot dir": (with_item(0, shm_name=PREFIX + "/.."), "mm_items[0].shm_name"),
    "shm_name space": (with_item(0, shm_name=PREFIX + "a b"), "mm_items[0].shm_name"),
    "shm_name unicode": (with_item(0, shm_name=PREFIX + "é"), "mm_items[0].shm_name"),
    "shm_name 201 chars": (with_item(0, shm_name=PREFIX + "a" * (201 - len(PREFIX))), "mm_items[0].shm_name"),
    "shm_name bin": (with_item(0, shm_name=(PREFIX + "abc").encode()), "mm_items[0].shm_name"),
    "offset negative": (with_item(0, offset=-1), "mm_items[0].offset"),
    "offset float": (with_item(0, offset=1.0), "mm_items[0].offset"),
    "offset bool": (with_item(0, offset=True), "mm_items[0].offset"),
    "pooled int": (with_item(0, pooled=1), "mm_items[0].pooled"),
    "pooled str": (with_item(0, pooled="true"), "mm_items[0].pooled"),
    "frame missing": (without_item_key(1, "frame"), "mm_items[1].frame"),
    "frame 0": (with_item(1, frame=0), "mm_items[1].frame"),
    "frame out of range": (with_item(1, frame=2), "mm_items[1].frame"),
    "frame negative": (with_item(1, frame=-1), "mm_items[1].frame"),
    "frame str": (with_item(1, frame="1"), "mm_items[1].frame"),
    "frame bool": (with_item(1, frame=True), "mm_items[1].frame"),
    "frame wrong length": (with_item(1, shape=[2, 4]), "mm_items[1].frame"),
    "session ref missing": (base(mm_items=[{"transport": "session", "modality": "image"}]), "mm_items[0].ref"),
    "session ref int": (base(mm_items=[{"transport": "session", "ref": 3}]), "mm_items[0].ref"),
    "item id int": (with_item(0, id=3), "mm_items[0].id"),
    "cuda_ipc without ipc": (base(mm_items=[{"modality": "image", "transport": "cuda_ipc", "dtype": "uint8",
                                             "shape": [4]}]), "mm_items[0].ipc"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_field_is_named(case):
    header, field = CASES[case]
    exc = bad(header)
    assert exc.field == field, str(exc)
    assert str(exc).startswith(field + ":")
    # the rid travels with the 400 whenever it is readable
    rid = header.get("rid")
    expected_rid = rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None
    assert exc.rid == expected_rid


def test_over_max_input_len():
    limits = Limits(max_input_len=4)
    assert decode(frames_of(base(input_ids=[1, 2, 3, 4])), limits).input_ids.size == 4
    exc = bad(base(input_ids=[1, 2, 3, 4, 5]), limits=limits)
    assert exc.field == "input_ids" and exc.rid == "r-1"
    exc = bad(base(input_ids=np.arange(5, dtype="<i4").tobytes()), limits=limits)
    assert exc.field == "input_ids"


def test_frame_wrong_length_either_way():
    assert bad(base(), bytes(23)).field == "mm_items[1].frame"
    assert bad(base(), bytes(25)).field == "mm_items[1].frame"


def test_too_many_items():
    limits = Limits(max_items=1)
    exc = bad(base(), limits=limits)
    assert exc.field == "mm_items" and exc.rid == "r-1"


def test_abort_and_close_session_fields():
    with pytest.raises(BadRequest) as ei:
        decode([pack({"v": 1, "type": "abort"})], LIMITS)
    assert ei.value.field == "rid" and ei.value.rid is None
    with pytest.raises(BadRequest) as ei:
        decode([pack({"v": 1, "type": "close_session", "session_id": 4})], LIMITS)
    assert ei.value.field == "session_id"


def test_version_checked_before_anything_else():
    exc = bad(base(v=2, input_ids="garbage"))
    assert exc.field == "v" and exc.rid == "r-1"


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x92\x01", pack([1, 2]), pack("embed"), pack(None), pack(3), b"\x81\xa1v",
    pack({1: 2}),  # a map with a non-str key is not a header
], ids=["empty", "never-used-byte", "truncated-array", "array", "str", "nil", "int", "truncated-map",
        "int-key"])
def test_unreadable_header(frame):
    with pytest.raises(BadRequest) as ei:
        decode([frame], LIMITS)
    assert ei.value.field == "header"
    assert ei.value.rid is None


def test_trailing_bytes_after_header_are_unreadable():
    with pytest.raises(BadRequest) as ei:
        decode([pack(base()) + b"\x00"], LIMITS)
    assert ei.value.field == "header" and ei.value.rid is None


PAD = bytes(SMALL_HEADER + 1)  # a field that makes a header too big for the one-call decode


@pytest.mark.parametrize("pad", [{}, {"pad": PAD}], ids=["small", "big"])
@pytest.mark.parametrize("frame_of", [
    lambda h: pack(h) + b"\x00",  # one trailing byte
    lambda h: pack({**h, 1: 2}),  # a top-level int key
    lambda h: pack({**h, "x": {1: 2}}),  # a nested int key
    lambda h: pack(h)[:-1],  # truncated
], ids=["trailing-byte", "int-key", "nested-int-key", "truncated"])
def test_unreadable_header_whatever_its_size(frame_of, pad):
    with pytest.raises(BadRequest) as ei:
        decode([frame_of(base(**pad))], LIMITS)
    assert ei.value.field == "header" and ei.value.rid is None, ei.value


def test_params_bounded_by_encoded_bytes_before_decoding():
    at = Limits(max_params_bytes=SMALL_HEADER * 2)
    fill = {"x": bytes(SMALL_HEADER * 2 - 8)}
    assert len(pack(fill)) <= at.max_params_bytes
    decode(frames_of(base(params=fill)), at)  # at the bound: accepted
    exc = bad(base(params={"x": bytes(SMALL_HEADER * 2)}), limits=at)
    assert exc.field == "params" and exc.rid == "r-1"
    big = len(pack({"x": bytes(SMALL_HEADER * 2)}))
    assert str(exc) == f"params: {big} bytes exceed max_params_bytes={SMALL_HEADER * 2}"


def test_params_bounded_by_element_count():
    limits = Limits(max_params_items=10)
    decode(frames_of(base(params={"a": [1, 2], "b": {"c": 4}, "d": 5})), limits)  # 6 + 2 + 2 elements
    exc = bad(base(params={"a": [1, 2, 3], "b": {"c": 4}, "d": 5}), limits=limits)
    assert (exc.field, exc.rid, str(exc)) == ("params", "r-1", "params: more than 10 elements (max_params_items)")
    exc = bad(base(params={"x": [{}] * 5000, "pad": PAD}))  # the big-header path too
    assert exc.field == "params" and "max_params_items" in str(exc)


def test_a_big_header_builds_a_bounded_number_of_maps_and_arrays():
    n = LIMITS.max_containers + 1
    exc = bad(base(mm_items=[{}] * n, pad=PAD))
    assert (exc.field, exc.rid, str(exc)) == \
        ("mm_items", "r-1", f"mm_items: more than {LIMITS.max_containers} maps and arrays in the header (max_items)")
    h = base(pad=PAD)
    assert isinstance(unpack_header(pack(h)), dict) and decode(frames_of(h), LIMITS).rid == "r-1"


@pytest.mark.parametrize("junk", [b"\x00", b""], ids=["trailing-byte", "none"])
def test_lenient_reading_finds_names_past_what_strict_reading_refuses(junk):
    h = base(pad=PAD, x={1: 2})
    h["mm_items"] = [{}] * LIMITS.max_containers + h["mm_items"]  # too many maps for the strict read
    frame = pack(h) + junk
    with pytest.raises(BadRequest):
        decode([frame], LIMITS)
    assert owned_segments(unpack_lenient(frame), PREFIX) == [PREFIX + "abc"]
    assert owned_segments(unpack_lenient(pack(base()) + junk), PREFIX) == [PREFIX + "abc"]
    str8 = b"\x81\xd9\x08mm_items" + pack([{"transport": "shm", "shm_name": PREFIX + "s8"}])  # a longer str form
    assert owned_segments(unpack_lenient(str8 + junk), PREFIX) == [PREFIX + "s8"]


def test_decode_does_not_mutate_header_copy():
    h = base()
    snapshot = copy.deepcopy(h)
    decode(frames_of(h), LIMITS)
    assert h == snapshot


# ---------------------------------------------------------------- owned_segments / valid_shm_name

def test_owned_segments_from_a_malformed_header():
    good = PREFIX + "owned_1"
    header = {
        "v": 2, "rid": 12, "input_ids": "nope",
        "mm_items": [
            {"transport": "shm", "shm_name": good, "dtype": "complex", "shape": -1},
            {"transport": "shm", "shm_name": good},  # named twice: listed once
            {"transport": "shm", "shm_name": PREFIX + "pooled", "pooled": True},
            {"transport": "shm", "shm_name": PREFIX + "pooled_junk", "pooled": "yes"},
            {"transport": "shm", "shm_name": "psm_other"},
            {"transport": "shm", "shm_name": "/" + PREFIX + "slash"},
            {"transport": "shm", "shm_name": PREFIX + "../../etc/passwd"},
            {"transport": "shm", "shm_name": PREFIX + "x" * 200},
            {"transport": "shm", "shm_name": 5},
            {"transport": "shm"},
            {"transport": "inline", "shm_name": PREFIX + "inline_named"},
            {"shm_name": PREFIX + "no_transport"},
            "not a map",
            None,
            {"transport": "shm", "shm_name": PREFIX + "owned_2", "pooled": False, "offset": -5},
        ],
    }
    assert owned_segments(header, PREFIX) == [good, PREFIX + "owned_2"]
    assert owned_segments(unpack_lenient(pack(header)), PREFIX) == [good, PREFIX + "owned_2"]
    header["mm_items"].insert(0, {"transport": "shm", "junk": [[]] * 5000, "shm_name": PREFIX + "big_item"})
    assert owned_segments(unpack_lenient(pack(header)), PREFIX) == [PREFIX + "big_item", good, PREFIX + "owned_2"]
    with pytest.raises(BadRequest):
        decode([pack(header)], LIMITS)


@pytest.mark.parametrize("header", [None, [], "x", 5, {}, {"mm_items": None}, {"mm_items": {"a": 1}},
                                    {"mm_items": "mmsched_x"}])
def test_owned_segments_of_nothing(header):
    assert owned_segments(header, PREFIX) == []


def test_owned_segments_respects_configured_prefix():
    header = {"mm_items": [{"transport": "shm", "shm_name": "mmsched_a"},
                           {"transport": "shm", "shm_name": "custom_b"}]}
    assert owned_segments(header, "custom_") == ["custom_b"]
    assert owned_segments(header, PREFIX) == ["mmsched_a"]


@pytest.mark.parametrize("name,ok", [
    (PREFIX + "abc", True),
    (PREFIX + "A-Z.0_9", True),
    (PREFIX, True),
    (PREFIX + "a" * (200 - len(PREFIX)), True),
    (PREFIX + "a" * (201 - len(PREFIX)), False),
    ("abc", False),
    ("MMSCHED_abc", False),
    ("/" + PREFIX + "abc", False),
    (PREFIX + "a/b", False),
    (PREFIX + "..", True),   # no slash: a plain file name in /dev/shm, not a path
    (PREFIX + "/..", False),
    (PREFIX + "a\x00b", False),
    (PREFIX + "a\nb", False),
    (PREFIX + "ä", False),
    (b"mmsched_abc", False),
    (None, False),
    (5, False),
])
def test_valid_shm_name(name, ok):
    assert valid_shm_name(name, PREFIX) is ok


# ---------------------------------------------------------------- the plain request's short path

def _ids(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "little", signed=True) for v in values)


PLAIN_VARIANTS = [
    {}, {"type": "generate"}, {"rid": "é" * 128}, {"rid": "x" * 129}, {"rid": ""}, {"rid": 7},
    {"v": True}, {"v": 1.0}, {"v": 2}, {"type": "ping"}, {"type": b"embed"}, {"type": ["embed"]},
    {"input_ids": b""}, {"input_ids": b"\x01\x00\x00"}, {"input_ids": _ids(0, -1)}, {"input_ids": _ids(2**31 - 1)},
    {"input_ids": _ids(*range(16))}, {"input_ids": _ids(*range(17))}, {"input_ids": [1, 2]}, {"input_ids": "abcd"},
    {"session_id": "s"}, {"params": {}}, {"mm_items": []}, {"want_digest": False},
]


def _outcome(frames: list, limits: Limits):
    try:
        r = decode(frames, limits)
    except BadRequest as exc:
        return ("400", exc.field, str(exc), exc.rid)
    if not isinstance(r, Request):
        return (type(r).__name__,)
    return (r.rid, r.type, r.input_ids.dtype.str, r.input_ids.tolist(), r.items, r.session_id, r.max_new_tokens,
            r.want_digest, r.params)


@pytest.mark.parametrize("limits", [Limits(max_input_len=16), Limits(max_new_tokens=4)], ids=["len16", "mnt4"])
@pytest.mark.parametrize("over", PLAIN_VARIANTS, ids=range(len(PLAIN_VARIANTS)))
def test_a_plain_request_decodes_as_the_full_checks_decide(over, limits):
    """A one-frame request naming only v, type, rid and input_ids takes a short path on the
    leader's loop; what it answers (the Request, or the 400 and its field) is what the full
    checks answer for the same header (a second frame sends any message down those)."""
    header = {"v": 1, "type": "embed", "rid": "r-1", "input_ids": _ids(1, 2, 3), **over}
    alone = _outcome([pack(header)], limits)
    assert alone == _outcome([pack(header), b""], limits)
    if not over:  # the control: a request, as sent; a cap below the default 8 is its default
        assert alone[0] == "r-1" and alone[3] == [1, 2, 3] and alone[2] == "<i4"
        assert alone[6] == min(8, limits.max_new_tokens)


@pytest.mark.parametrize("params", [None, {}, {"temperature": 0}], ids=["none", "empty", "other"])
def test_a_cap_below_the_default_is_what_a_request_without_max_new_tokens_gets(params):
    """Outside attack (session 54): with ``max_new_tokens`` set to 5 (allowed: 1 .. 2**20)
    every request that did not name it, embeds included, was a 400 asking for 1..5: the
    default 8 was over the cap. A request without it now asks for the cap."""
    limits = Limits(max_new_tokens=5)
    header = {"v": 1, "type": "embed", "rid": "r-1", "input_ids": [1, 2, 3]}
    if params is not None:
        header["params"] = params
    req = decode(frames_of(header), limits)
    assert isinstance(req, Request) and req.max_new_tokens == 5
    with pytest.raises(BadRequest, match=r"1\.\.5 \(max_new_tokens\)"):
        decode(frames_of({**header, "params": {"max_new_tokens": 6}}), limits)


# ---------------------------------------------------------------- maps as the protocol means them (outside attack)

def raw_map(*pairs) -> bytes:
    """A map as a client could pack it, keys repeated or of any type, in the order given."""
    pk = msgpack.Packer(use_bin_type=True)
    return pk.pack_map_header(len(pairs)) + b"".join(pk.pack(k) + pk.pack(v) for k, v in pairs)


def shm_item(name: str) -> dict:
    return {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [4], "shm_name": PREFIX + name}


PLAIN = [("v", 1), ("type", "embed"), ("rid", "r-1"), ("input_ids", _ids(1, 2))]


@pytest.mark.parametrize("pad", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("pairs, where", [
    ([("v", 2), *PLAIN], "'v'"),                                            # the check read one v, a client meant another
    ([*PLAIN, ("rid", "r-2")], "'rid'"),
    ([*PLAIN, ("mm_items", [shm_item("a")]), ("mm_items", [shm_item("b")])], "'mm_items'"),
    ([*PLAIN, ("mm_items", [{**shm_item("a"), "shape": [4]} | {"x": 1}]),
      ("params", {"k": 1})], None),                                         # the control: no key twice
])
def test_a_map_that_names_a_key_twice_is_refused(pairs, where, pad):
    if pad:
        pairs = [*pairs, ("pad", PAD)]
    frame = raw_map(*pairs)
    if where is None:
        assert decode([frame], LIMITS).rid == "r-1"
        return
    with pytest.raises(BadRequest) as ei:
        decode([frame], LIMITS)
    assert ei.value.field == "header" and f"key {where}" in str(ei.value) and "more than once" in str(ei.value)


def test_a_key_twice_inside_an_item_or_params_is_refused_too():
    item = raw_map(*shm_item("a").items(), ("shm_name", PREFIX + "b"))
    frame = raw_map(*PLAIN[:3], ("input_ids", [1]), ("mm_items", msgpack.ExtType(0, b"")))
    frame = frame.replace(pack(msgpack.ExtType(0, b"")), b"\x91" + item)  # mm_items: [that item]
    with pytest.raises(BadRequest) as ei:
        decode([frame], LIMITS)
    assert "key 'shm_name' more than once" in str(ei.value)
    # what a refused message hands over: every segment it named, the shadowed one too
    assert owned_segments(unpack_lenient(frame), PREFIX) == [PREFIX + "a", PREFIX + "b"]
    twice = raw_map(*PLAIN, ("mm_items", [shm_item("a")]), ("mm_items", [shm_item("b")]))
    assert owned_segments(unpack_lenient(twice), PREFIX) == [PREFIX + "a", PREFIX + "b"]
    params = raw_map(*PLAIN, ("params", msgpack.ExtType(0, b"")))
    params = params.replace(pack(msgpack.ExtType(0, b"")), raw_map(("k", 1), ("k", 2)))
    assert "key 'k' more than once" in str(bad_frame(params))


def bad_frame(frame: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as ei:
        decode([frame], LIMITS)
    return ei.value


@pytest.mark.parametrize("pad", [False, True], ids=["small", "big"])
def test_header_and_item_keys_must_be_strings_and_at_most_64(pad):
    extra = [("pad", PAD)] if pad else []
    exc = bad_frame(raw_map(*PLAIN, (b"mm_items", [shm_item("a")]), *extra))
    assert (exc.field, str(exc)) == ("header", "header: its keys must be strings")
    assert owned_segments(unpack_lenient(raw_map(*PLAIN, (b"mm_items", [shm_item("a")]))), PREFIX) == [PREFIX + "a"]
    for odd in [raw_map(*PLAIN, (7, 1), *extra), raw_map(*PLAIN, ("params", {1: 2}), *extra),
                raw_map(*PLAIN, ("mm_items", [{**shm_item("a"), None: 1}]), *extra)]:  # neither str nor bin
        assert str(bad_frame(odd)) == "header: its keys must be strings"
    many = [(f"k{i}", i) for i in range(65 - len(PLAIN) - len(extra))]
    exc = bad_frame(raw_map(*PLAIN, *many, *extra))
    assert (exc.field, str(exc)) == ("header", "header: a map of 65 keys (at most 64)")
    assert decode([raw_map(*PLAIN, *many[1:], *extra)], LIMITS).rid == "r-1"  # 64: taken
    item = {**shm_item("a"), **{f"k{i}": i for i in range(65 - len(shm_item("a")))}}
    exc = bad_frame(raw_map(*PLAIN, ("mm_items", [item]), *extra))
    assert (exc.field, str(exc)) == ("mm_items[0]", "mm_items[0]: a map of 65 keys (at most 64)")
    binkey = raw_map(*shm_item("a").items(), (b"x", 1))
    frame = raw_map(*PLAIN, ("mm_items", 0), *extra).replace(b"\xa8mm_items\x00", b"\xa8mm_items\x91" + binkey)
    exc = bad_frame(frame)
    assert (exc.field, str(exc)) == ("mm_items[0]", "mm_items[0]: its keys must be strings")


DEEP = b"\x91" * 1100 + b"\x01"  # 1,100 arrays inside each other: past MessagePack's 1,024


@pytest.mark.parametrize("pad", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("rid_first", [True, False], ids=["rid-first", "rid-after"])
def test_a_field_nested_past_what_messagepack_reads_is_refused_by_name_with_the_rid(pad, rid_first):
    fields = [("junk", 0), *PLAIN] if not rid_first else [*PLAIN, ("junk", 0)]
    frame = raw_map(*fields, *([("pad", PAD)] if pad else []))
    frame = frame.replace(b"\xa4junk\x00", b"\xa4junk" + DEEP)
    exc = bad_frame(frame)
    assert (exc.field, exc.rid, str(exc)) == ("junk", "r-1", "junk: nested deeper than 1024 levels")
    ok = raw_map(*PLAIN, ("junk", 0)).replace(b"\xa4junk\x00", b"\xa4junk" + b"\x91" * 200 + b"\x01")
    assert decode([ok], LIMITS).rid == "r-1"  # unknown keys are ignored, however nested, within the limit


@pytest.mark.parametrize("ids, problem", [
    ([True, 1], "must be an array of ints or a bin of int32"),
    ([1, 2, False], "must be an array of ints or a bin of int32"),
    ([1, 2.0], "must be an array of ints or a bin of int32"),
    ([2**64 - 1], "each id must satisfy 0 <= id < 2^31"),
    ([1, 2**64 - 1], "each id must satisfy 0 <= id < 2^31"),
    ([1, -1], "each id must satisfy 0 <= id < 2^31"),
])
def test_an_id_array_holds_ints_alone(ids, problem):
    exc = bad(base(input_ids=ids))
    assert (exc.field, str(exc)) == ("input_ids", f"input_ids: {problem}")
    assert decode(frames_of(base(input_ids=[0, 2**31 - 1])), LIMITS).input_ids.tolist() == [0, 2**31 - 1]


@pytest.mark.parametrize("where", ["item-between", "field-before-items"])
def test_a_message_refused_for_depth_still_hands_over_every_segment_it_names(where):
    """Outside attack: a too-deep item between two shm items, or a too-deep field before
    mm_items, kept the 400 path from finding the segments (left to the sweep)."""
    items = raw_map(("mm_items", [shm_item("a"), 0, shm_item("b"), {**shm_item("p"), "pooled": True}]))[1:]
    items = items.replace(b"\x94" + pack(shm_item("a")) + b"\x00", b"\x94" + pack(shm_item("a")) + DEEP)
    if where == "item-between":
        frame = bytes([0x85]) + raw_map(*PLAIN)[1:] + items  # PLAIN's four entries, then mm_items
    else:
        frame = bytes([0x86]) + raw_map(*PLAIN, ("junk", 0))[1:].replace(b"\xa4junk\x00", b"\xa4junk" + DEEP) + items
    assert isinstance(bad_frame(frame), BadRequest)
    assert owned_segments(unpack_lenient(frame), PREFIX) == [PREFIX + "a", PREFIX + "b"]


def test_a_field_too_deep_and_too_big_to_walk_past_is_still_refused():
    """Past what the hand walk takes (deep, then 4,095 values more): the fields after it
    cannot be found, so the message is refused, never taken without them."""
    junk = DEEP[:-1] + b"\xdc\x0f\xff" + b"\x01" * 4095
    frame = bytes([0x86]) + raw_map(*PLAIN, ("junk", 0))[1:].replace(b"\xa4junk\x00", b"\xa4junk" + junk)
    frame += pack("mm_items") + pack([shm_item("a")])
    exc = bad_frame(frame)
    assert (exc.field, exc.rid) == ("junk", "r-1") and "nested deeper" in str(exc)


def test_an_item_that_says_pooled_twice_over_is_never_released_by_a_400():
    """A shadowed ``pooled: true`` still counts: a pooled segment is the client's to keep."""
    item = raw_map(*shm_item("p").items(), ("pooled", True), ("pooled", False))
    frame = raw_map(*PLAIN, ("mm_items", 0)).replace(b"\xa8mm_items\x00", b"\xa8mm_items\x91" + item)
    assert isinstance(bad_frame(frame), BadRequest)
    assert owned_segments(unpack_lenient(frame), PREFIX) == []
