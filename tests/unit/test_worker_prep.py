"""The worker's request preparation, no sockets: chat JSON → input ids and pixel values,
and every bad image refused as a BadRequest (HTTP 400) before anything is sent."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

from mmsched.engines.hf import SHIPPED  # noqa: E402
from mmsched.worker.prep import BadRequest, Preprocessor  # noqa: E402


@pytest.fixture(scope="module")
def prep():
    return Preprocessor(str(SHIPPED), max_image_bytes=64 << 10, max_image_pixels=512 * 512, max_new_tokens=32,
                        max_images=4, max_pixels=300_000)


def png(size=(40, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    PIL.new("RGB", size, (200, 30, 30)).save(buf, fmt)
    return buf.getvalue()


def body(*images: bytes, text="What is this?", url=None, **extra) -> bytes:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url or "data:image/png;base64," + base64.b64encode(i).decode()}}
              for i in images]
    return json.dumps({"messages": [{"role": "user", "content": parts}], **extra}).encode()


def test_each_image_becomes_pixel_values_and_its_image_tokens(prep):
    p = prep.prepare(body(png(), png((300, 200), "JPEG"), max_tokens=5))
    assert [tuple(t.shape) for t in p.pixels] == [(1, 3, 32, 32)] * 2
    assert p.input_ids.count(prep.image_token) == 2 * prep.tokens_per_image and p.input_ids[0] == prep.bos
    assert p.max_new_tokens == 5
    assert prep.tokenizer.decode(p.input_ids).endswith("What is this?\nASSISTANT:")


def test_text_only_and_a_plain_string_content(prep):
    p = prep.prepare(json.dumps({"messages": [{"role": "user", "content": "hello world"}]}).encode())
    assert p.pixels == [] and prep.image_token not in p.input_ids


def test_decode_stops_at_end_of_sequence(prep):
    ids = prep.tokenizer.encode("hello world").ids
    assert prep.decode(ids + [prep.eos, 7]) == ("hello world", "stop")
    assert prep.decode(ids) == ("hello world", "length")


@pytest.mark.parametrize("raw, url, words", [
    (b"GIF89a but not really", None, "not a readable image"),
    (png()[:60], None, "truncated"),
    (png((600, 600)), None, "over"),
    (None, "data:image/png;base64,@@@", "not a readable image"),
    (None, "https://example.com/cat.png", "data URLs"),
    (b"\0" * (70 << 10), None, "larger than"),
], ids=["not-an-image", "truncated", "too-many-pixels", "bad-base64", "remote-url", "too-many-bytes"])
def test_a_bad_image_is_refused(prep, raw, url, words):
    with pytest.raises(BadRequest, match=words):
        prep.prepare(body(*([raw] if raw is not None else []), url=url) if url is None else body(png(), url=url))


@pytest.mark.parametrize("doc", [b"{", b"[]", b'{"messages": []}', b'{"messages": [{"role": "robot", "content": "x"}]}',
                                 b'{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}',
                                 b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 33}'])
def test_a_malformed_chat_is_refused(prep, doc):
    with pytest.raises(BadRequest):
        prep.prepare(doc)


def test_the_shipped_tokenizer_matches_the_model_config(prep, tmp_path):
    from transformers import AutoConfig

    from mmsched.engines import hf_tiny

    cfg = AutoConfig.from_pretrained(SHIPPED)
    assert prep.tokenizer.get_vocab_size() == cfg.text_config.vocab_size
    assert prep.tokenizer.token_to_id("<image>") == cfg.image_token_index == prep.image_token
    hf_tiny.write(str(tmp_path))  # the files in configs/hf-tiny are what hf_tiny writes
    for name in ("tokenizer.json", "preprocessor_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((SHIPPED / name).read_text()), name


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (no pixel data): what a decompression bomb shows first."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_text_over_the_character_cap_is_refused_before_tokenizing(prep, monkeypatch):
    monkeypatch.setattr(prep, "_encode", lambda text: pytest.fail("tokenized a text over the cap"))
    with pytest.raises(BadRequest, match=f"over the limit of {prep.max_chars} .*context of 2048 tokens"):
        prep.prepare(body(text="a" * (prep.max_chars + 1)))


def test_a_prompt_over_the_models_context_is_refused(prep):
    text = " ".join(f"{i}" for i in range(1500))  # under the character cap, over 2048 tokens
    assert len(text) <= prep.max_chars
    with pytest.raises(BadRequest, match=r"\+ max_tokens 16 is over the model's context of 2048 tokens"):
        prep.prepare(body(text=text))
    short = prep.prepare(body(png(), text="hi", max_tokens=32))
    assert len(short.input_ids) + 32 <= prep.context


def test_user_text_never_becomes_special_tokens(prep):
    p = prep.prepare(body(text="<image> <s> </s> <pad> <unk>"))
    special = {prep.image_token, prep.bos, prep.eos, 0, 3}
    assert p.input_ids[0] == prep.bos and not special & set(p.input_ids[1:]), p.input_ids
    assert "<image> <s> </s>" in prep.tokenizer.decode(p.input_ids)


@pytest.mark.parametrize("doc, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (body(stream=True), "streaming is not supported"),
    (body(*[png()] * 5), "5 images; at most 4 per request"),
    (body(png((500, 500)), png((300, 300))), "340000 pixels in all are over the limit of 300000"),
    (body(png_header(20000, 20000)), "too large"),
], ids=["deep-json", "stream", "too-many-images", "too-many-pixels-in-all", "decompression-bomb"])
def test_cheap_refusals_name_their_limit(prep, doc, words):
    with pytest.raises(BadRequest, match=words):
        prep.prepare(doc)


def test_the_bytes_decide_the_image_type_and_errors_leak_no_object_reprs(prep):
    p = prep.prepare(body(png(), url="data:image/jpeg;base64," + base64.b64encode(png()).decode()))
    assert [tuple(t.shape) for t in p.pixels] == [(1, 3, 32, 32)]
    with pytest.raises(BadRequest) as err:
        prep.prepare(body(b"not an image at all"))
    assert "0x" not in str(err.value) and "BytesIO" not in str(err.value), err.value


def test_an_unexpected_error_in_a_handler_is_a_json_500_naming_it():
    import asyncio

    from aiohttp.test_utils import make_mocked_request

    from mmsched.worker.app import errors

    async def broken(_request):
        raise KeyError("surprise")

    resp = asyncio.run(errors(make_mocked_request("POST", "/v1/chat/completions"), broken))
    assert resp.status == 500 and json.loads(resp.body)["error"]["message"] == "internal error: KeyError: 'surprise'"
