"""A chat request → input ids and pixel values: pure code, every refusal a ``BadRequest``.

Images come as base64 data URLs; each is checked before it is decoded (size of the
payload, pixels from the header) and fully loaded (a truncated file fails here), so a
bad image is a 400 before anything reaches mmsched.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
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
                 max_new_tokens: int = 256):
        from tokenizers import Tokenizer
        from transformers import AutoConfig, CLIPImageProcessorPil

        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.images = CLIPImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.image_token = cfg.image_token_index
        self.tokens_per_image = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
        self.bos, self.eos = cfg.text_config.bos_token_id, cfg.text_config.eos_token_id
        self.max_image_bytes, self.max_image_pixels = max_image_bytes, max_image_pixels
        self.max_new_tokens = max_new_tokens

    def prepare(self, body: bytes) -> Prepared:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list) or not doc["messages"]:
            raise BadRequest("'messages' must be a non-empty list")
        limit = doc.get("max_completion_tokens", doc.get("max_tokens", 16))
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= self.max_new_tokens:
            raise BadRequest(f"max_tokens must be an integer in 1..{self.max_new_tokens}")
        prompt, pixels = "", []
        for msg in doc["messages"]:
            if not isinstance(msg, dict) or msg.get("role") not in ROLES:
                raise BadRequest(f"each message needs a role ({', '.join(ROLES)}) and content")
            text, images = _parts(msg.get("content"))
            pixels += [self.pixels(url) for url in images]
            prompt += f"{msg['role'].upper()}: " + "<image>\n" * len(images) + text + "\n"
        return Prepared(self.tokenize(prompt + "ASSISTANT:"), pixels, limit)

    def tokenize(self, prompt: str) -> list[int]:
        ids = [self.bos]
        for t in self.tokenizer.encode(prompt, add_special_tokens=False).ids:
            ids += [t] * (self.tokens_per_image if t == self.image_token else 1)
        return ids

    def decode(self, ids: list[int]) -> tuple[str, str]:
        """The text and the OpenAI finish reason."""
        stop = self.eos in ids
        return self.tokenizer.decode(ids[: ids.index(self.eos)] if stop else ids), ("stop" if stop else "length")

    def pixels(self, url: str) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError

        head, _, data = url.partition(",")
        if not (head.startswith("data:image/") and head.endswith(";base64")):
            raise BadRequest("images must be base64 data URLs (data:image/...;base64,...)")
        if len(data) > self.max_image_bytes * 4 // 3 + 4:
            raise BadRequest(f"image larger than {self.max_image_bytes} bytes")
        try:
            raw = base64.b64decode(data, validate=True)
            with Image.open(io.BytesIO(raw)) as img:
                if img.width * img.height > self.max_image_pixels:
                    raise BadRequest(f"image of {img.width}x{img.height} pixels is over {self.max_image_pixels}")
                img.load()  # decodes everything: a truncated or corrupt file raises here
                rgb = img.convert("RGB")
        except (binascii.Error, UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            if isinstance(exc, BadRequest):
                raise
            raise BadRequest(f"not a readable image: {type(exc).__name__}: {exc}") from None
        return self.images(images=[rgb], return_tensors="pt")["pixel_values"].to(torch.float32)


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
