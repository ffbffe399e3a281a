"""A chat request → input ids and pixel values: pure code, every refusal a ``BadRequest``.

Everything cheap is checked before anything costly: the text's length against a
character cap derived from the model's context (before tokenizing), every image's
payload size and header pixels, summed over the request (before decoding). Images are
then fully loaded (a truncated file fails here), so a bad image is a 400 before anything
reaches mmsched. User text never becomes special tokens: it is tokenized with
special-token parsing off, and the ``<image>`` tokens come only from image parts.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    """The caller's fault: HTTP 400 with this message."""


@dataclass
class Prepared:
    input_ids: list[int]
    pixels: list[torch.Tensor]  # one float32 [1, 3, H, W] per image, in prompt order
    max_new_tokens: int


class Preprocessor:
    """The model directory's tokenizer.json and preprocessor_config.json, plus the limits."""

    def __init__(self, model_dir: str, max_image_bytes: int = 8 << 20, max_image_pixels: int = 16 << 20,
                 max_new_tokens: int = 256, max_images: int = 16, max_pixels: int = 8 << 20,
                 max_input_len: int = 131072):
        from tokenizers import Tokenizer
        from transformers import AutoConfig, CLIPImageProcessorPil

        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tokenizer.encode_special_tokens = True  # "<s>" typed by a user is text, not a token
        self.images = CLIPImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.image_token = cfg.image_token_index
        self.tokens_per_image = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
        self.bos, self.eos = cfg.text_config.bos_token_id, cfg.text_config.eos_token_id
        self.context = min(cfg.text_config.max_position_embeddings, max_input_len)
        self.max_chars = self.context * _longest_token(self.tokenizer)  # more text surely overflows
        self.max_image_bytes, self.max_image_pixels = max_image_bytes, max_image_pixels
        self.max_new_tokens, self.max_images, self.max_pixels = max_new_tokens, max_images, max_pixels

    def prepare(self, body: bytes) -> Prepared:
        doc = _load(body)
        if doc.get("stream"):
            raise BadRequest("streaming is not supported: send \"stream\": false or leave it out")
        limit = doc.get("max_completion_tokens", doc.get("max_tokens", 16))
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= self.max_new_tokens:
            raise BadRequest(f"max_tokens must be an integer in 1..{self.max_new_tokens}")
        turns = [_turn(msg) for msg in doc["messages"]]
        self._check_sizes(turns)
        opened = [self.open_image(url) for _, _, images in turns for url in images]
        self._check_pixels(opened)
        pixels = [self.decode_image(img) for img in opened]
        ids = self.tokenize(turns)
        if len(ids) + limit > self.context:
            raise BadRequest(f"prompt of {len(ids)} tokens + max_tokens {limit} is over the model's context "
                             f"of {self.context} tokens")
        return Prepared(ids, pixels, limit)

    def _check_sizes(self, turns) -> None:
        chars = sum(len(text) for _, text, _ in turns)
        if chars > self.max_chars:
            raise BadRequest(f"text of {chars} characters is over the limit of {self.max_chars} "
                             f"(the model's context of {self.context} tokens)")
        images = sum(len(urls) for _, _, urls in turns)
        if images > self.max_images:
            raise BadRequest(f"{images} images; at most {self.max_images} per request")

    def _check_pixels(self, opened) -> None:
        total = sum(img.width * img.height for img in opened)
        if total > self.max_pixels:
            raise BadRequest(f"images of {total} pixels in all are over the limit of {self.max_pixels} per request")

    def tokenize(self, turns) -> list[int]:
        """``ROLE: <image>…text`` per message, then ``ASSISTANT:``; only image parts make image tokens."""
        ids = [self.bos]
        for role, text, images in turns:
            ids += self._encode(f"{role.upper()}: ")
            ids += ([self.image_token] * self.tokens_per_image + self._encode("\n")) * len(images)
            ids += self._encode(text + "\n")
        return ids + self._encode("ASSISTANT:")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: list[int]) -> tuple[str, str]:
        """The text and the OpenAI finish reason."""
        stop = self.eos in ids
        return self.tokenizer.decode(ids[: ids.index(self.eos)] if stop else ids), ("stop" if stop else "length")

    def open_image(self, url: str):
        """The image with only its header read: the media type is not checked, the bytes decide."""
        from PIL import Image

        head, _, data = url.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64")):
            raise BadRequest("images must be base64 data URLs (data:image/...;base64,...)")
        if len(data) > self.max_image_bytes * 4 // 3 + 4:
            raise BadRequest(f"image larger than {self.max_image_bytes} bytes")
        with _unreadable():
            img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        if img.width * img.height > self.max_image_pixels:
            raise BadRequest(f"image of {img.width}x{img.height} pixels is over {self.max_image_pixels}")
        return img

    def decode_image(self, img) -> torch.Tensor:
        with _unreadable(), img:
            img.load()  # decodes everything: a truncated or corrupt file raises here
            rgb = img.convert("RGB")
        return self.images(images=[rgb], return_tensors="pt")["pixel_values"].to(torch.float32)


@contextmanager
def _unreadable():
    """Turns Pillow's and base64's complaints into a BadRequest (without object reprs)."""
    from PIL import Image, UnidentifiedImageError

    try:
        yield
    except BadRequest:
        raise
    except Image.DecompressionBombError as exc:
        raise BadRequest(f"image too large to decode: {exc}") from None
    except (binascii.Error, UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        message = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "(the data)", str(exc))
        raise BadRequest(f"not a readable image: {type(exc).__name__}: {message}") from None


def _load(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except RecursionError:
        raise BadRequest("body is JSON nested too deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list) or not doc["messages"]:
        raise BadRequest("'messages' must be a non-empty list")
    return doc


def _turn(msg) -> tuple[str, str, list[str]]:
    if not isinstance(msg, dict) or msg.get("role") not in ROLES:
        raise BadRequest(f"each message needs a role ({', '.join(ROLES)}) and content")
    return (msg["role"], *_parts(msg.get("content")))


def _longest_token(tokenizer) -> int:
    """Characters in the longest ordinary token: a text of N characters is at least N / this tokens."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return max(len(t) for t in tokenizer.get_vocab() if t not in special)
def _parts(content) -> tuple[str, list[str]]:
    """OpenAI content: a string, or a list of {"type": "text"} and {"type": "image_url"} parts."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise BadRequest("content must be a string or a list of parts")
    text, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind == "image_url" and isinstance(part.get("image_url"), dict) and isinstance(part["image_url"].get("url"), str):
            images.append(part["image_url"]["url"])
        else:
            raise BadRequest("each content part is {'type': 'text', 'text': ...} or "
                             "{'type': 'image_url', 'image_url': {'url': ...}}")
    return "".join(text), images
