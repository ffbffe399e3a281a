"""The request mix: one seeded draw per request in send order, and the features each request brings."""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch

from ..client import Feature, cuda_ipc, inline, pooled, raw, ref, shm
from ..producers import create_segment
from .spec import CLIENT_FAULTS, LoadSpec


class Session:
    """A session's turns as the generator sees them: what the server holds for it, whether a turn is out."""

    __slots__ = ("n", "id", "turn", "stored", "ids", "sizes", "busy")

    def __init__(self, n: int, tag: str):
        self.n, self.id, self.turn = n, f"{tag}-s{n}", 0
        self.stored = False      # the server holds this session's features (a turn with them got 200)
        self.ids: list[str] = []
        self.sizes: list[int] = []  # payload size behind each id
        self.busy = False        # a turn is in flight


class Mix:
    """Seeded payloads (with their digests) and token ids, and the draw of each next request."""

    def __init__(self, spec: LoadSpec, rng: random.Random):
        self.spec, self.rng = spec, rng
        rng_np = np.random.default_rng(spec.seed)
        self.payloads = {n: torch.from_numpy(rng_np.integers(0, 256, n, dtype=np.uint8)) for n in spec.item_bytes}
        self.sha256 = {n: hashlib.sha256(t.numpy()).hexdigest() for n, t in self.payloads.items()}
        self.ids = [rng_np.integers(0, 32000, spec.input_len, dtype=np.int32) for _ in range(8)]
        self.counter = 0

    def draw(self) -> tuple[str, str, list[int], int]:
        """The next request's transport, fault, feature sizes and token ids (an index into ``ids``)."""
        r, s = self.rng, self.spec
        transport = s.transports[0] if len(s.transports) == 1 else r.choice(s.transports)
        sizes = [s.item_bytes[0] if len(s.item_bytes) == 1 else r.choice(s.item_bytes) for _ in range(s.items)]
        x = r.random()
        if x < s.fail_rate:
            fault = "fail"
        elif x < s.fail_rate + s.client_faults:
            fault = CLIENT_FAULTS[r.randrange(len(CLIENT_FAULTS))]
        elif x < s.fail_rate + s.client_faults + s.abort_rate:
            fault = "abort"
        else:
            fault = ""
        ids_k = r.randrange(len(self.ids))
        self.counter += 1
        return transport, fault, sizes, ids_k

    def features(self, transport: str, sizes: list[int], sess: Session | None) -> tuple[list[Feature], list[int]]:
        """The request's features, and the payload size behind each (a ref stands for its stored one)."""
        if sess is not None and sess.turn > 0 and sess.stored:
            return [ref(fid) for fid in sess.ids], sess.sizes
        make = {"pooled": pooled, "memfd": pooled, "shm": shm, "inline": inline, "cuda_ipc": cuda_ipc}[transport]
        feats = []
        for k, n in enumerate(sizes):
            fid = f"f{k}" if sess is not None else None
            feats.append(make(self.payloads[n], "image", fid))
        if sess is not None:
            sess.ids, sess.sizes = [f"f{k}" for k in range(len(sizes))], sizes
        return feats, sizes

    def fault_item(self, kind: str, sizes: list[int]) -> tuple[Feature, Any]:
        """A client-made bad item: (feature, segment to hand over once sent or None)."""
        n = sizes[0] if sizes else 64
        item = {"modality": "image", "transport": "shm", "dtype": "uint8", "shape": [n]}
        prefix = self.spec.shm_prefix
        if kind == "missing":
            return raw(dict(item, shm_name=f"{prefix}{os.getpid()}_missing_{self.counter}")), None
        if kind == "bad_name":
            return raw(dict(item, shm_name=f"not{prefix}{os.getpid()}_{self.counter}")), None
        seg = create_segment(bytes(max(1, n // 2)), prefix)  # too small: mmsched owns and unlinks it
        return raw(dict(item, shm_name=seg.name, shape=[max(2, n)])), seg
