"""The batched agreement: one all-gather per batch tells every rank which ranks failed which requests.

Each rank contributes one flag per request (0 ok, 1 failed here, 2 aborted — only the
leader sets 2, so an abort is agreed like any failure). An optional ``extra`` tensor rides
in the same all-gather as bytes (an engine's shards through ``EngineContext.gather``, digest
prefixes), so agreeing costs nothing extra. So do the error strings: each rank appends a fixed tail of ``ERR_SLOTS`` slots of
``ERR_WIDTH`` bytes (UTF-8, cut with a marker), so a failure costs no second collective.
The tail is the same size whatever failed (a size that depends on the failures would
need a collective to agree on); only a rank with more than ``ERR_SLOTS`` failures in one
batch makes every rank gather the strings again, as objects.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import GroupBroken

OK, FAILED, ABORTED = 0, 1, 2
ERR_WIDTH = 200                 # bytes of one error string in the gather; longer ones are cut
ERR_SLOTS = 4                   # error strings per rank carried in the flags' all-gather
TRUNCATED = " [truncated]"      # ends a cut string
_SLOT = 4 + 2 + ERR_WIDTH       # request index (int32), length (uint16), the bytes
_TAIL = -(-(4 + ERR_SLOTS * _SLOT) // 8) * 8  # this rank's failure count, the slots; 8-aligned


@dataclass
class Verdict:
    flags: np.ndarray                    # [world, n]
    errors: list[dict[int, str]] | None  # per rank: request index -> "Type: message"
    extra: torch.Tensor | None           # [world, n, k], gathered alongside
    rows: list | None = field(default=None, repr=False)  # ``flags.tolist()``, where the caller has it
    _ok: list = field(init=False, repr=False)       # per request, computed once per batch
    _aborted: list = field(init=False, repr=False)  # (not one numpy call per request and question)

    def __post_init__(self) -> None:
        # lists, built once: ``ok`` and ``aborted`` are asked per request (Python over the
        # lists: numpy's calls cost more than the loop at the batch sizes that matter)
        rows = self.flags.tolist() if self.rows is None else self.rows
        n = len(rows[0]) if rows else 0
        if not any(map(any, rows)):  # the usual batch: nothing failed or was aborted anywhere
            self._ok, self._aborted = [True] * n, [False] * n
        else:
            self._ok = [not any(col) for col in zip(*rows)]
            self._aborted = [f == ABORTED for f in rows[0]]

    def ok(self, i: int) -> bool:
        return self._ok[i]

    def aborted(self, i: int) -> bool:
        return self._aborted[i]

    def failed_ranks(self, i: int) -> list[int]:
        return [int(r) for r in np.flatnonzero(self.flags[:, i] == FAILED)]

    def message(self, i: int) -> str:
        """``rank 0: FileNotFoundError: ...; rank 1: ...`` — every failed rank, once."""
        errs = self.errors or []
        return "; ".join(f"rank {r}: {errs[r].get(i, 'unknown error') if r < len(errs) else 'unknown error'}"
                         for r in self.failed_ranks(i))


def agree(group, flags: np.ndarray, errors: dict[int, str], extra: torch.Tensor | None = None,
          stamp: tuple[int, ...] = ()) -> Verdict:
    """One collective for the batch (two only when a rank failed more than ERR_SLOTS requests).

    ``extra`` [n, ...] of any dtype rides along as bytes; the verdict's is [world, n, k].
    ``stamp`` must be the same on every rank: a rank that gathered another stamp is out of
    step with this one, and the group is broken (``GroupBroken``).

    Few numpy calls, by design: it runs on every rank at every batch, where each call costs
    several µs (the payload is one join; stamps and flags are read back as Python lists)."""
    if group.world == 1:
        return _alone(flags, errors, extra)
    n, k = len(flags), len(stamp)
    raw, dtype = _bytes(extra)
    payload = bytearray().join((struct.pack(f"<{k}q", *stamp), np.asarray(flags, dtype=np.int64).tobytes(),
                                raw, _tail(errors)))
    gathered = group.all_gather(np.frombuffer(payload, dtype=np.uint8))  # [world, bytes], fresh: views kept
    at = 8 * (k + n)  # the flags end, the extra starts, at byte ``at``
    head = gathered[:, :at].view(np.int64)  # stamps and flags, no copy (numpy reads unaligned rows)
    rows = head.tolist()
    if k and any(r[:k] != list(stamp) for r in rows):
        raise GroupBroken(f"the ranks are out of step: they gathered (step, call) {[r[:k] for r in rows]}")
    flag_rows = [r[k:] for r in rows] if k else rows
    table = None if extra is None else _table(gathered[:, at: at + raw.nbytes], dtype, extra.dtype, n)
    all_errors = None
    if any(FAILED in r for r in flag_rows):
        tails = gathered[:, at + raw.nbytes:]
        if any(int(t[:4].view(np.int32)[0]) > ERR_SLOTS for t in tails):
            all_errors = group.all_gather_object({i: clip(e) for i, e in errors.items()})
        else:
            all_errors = [_read_tail(t) for t in tails]
    return Verdict(head[:, k:], all_errors, table, flag_rows)


def _bytes(extra: torch.Tensor | None) -> tuple[np.ndarray, np.dtype | None]:
    """``extra`` as a C-contiguous array (of any dtype: the payload's join reads its buffer,
    ``nbytes`` long) and its numpy dtype (None where numpy has none: bfloat16). Numpy from
    here: each torch op costs several µs in place, at every batch, and ``numpy()`` is one op
    where the torch path is four; a contiguous extra (the usual) costs no other."""
    if extra is None:
        return _NO_BYTES, None
    try:
        a = extra.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks, a conjugate or negative view, a tensor that needs grad
        return extra.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy(), None
    return (a if a.flags.c_contiguous else np.ascontiguousarray(a)), a.dtype


def _table(rows: np.ndarray, dtype: np.dtype | None, torch_dtype: torch.dtype, n: int) -> torch.Tensor:
    """Every rank's extra bytes ``rows`` [world, bytes] as [world, n, k] of the extra's dtype:
    a view where torch can take one, else a copy. (Rank r's rows start r payloads into the
    gather: for complex128 in an odd batch, 8 bytes into an item, which numpy calls aligned
    and torch refuses.)"""
    world, size = rows.shape
    k = size // max(n, 1) // torch_dtype.itemsize  # (not -1: that fails where there are no bytes)
    if dtype is not None:
        view = rows.view(dtype).reshape(world, n, k)
        whole = view.flags.aligned and all(s % view.itemsize == 0 for s in view.strides)
        return torch.from_numpy(view if whole else view.copy())
    return torch.from_numpy(rows.copy()).view(torch_dtype).reshape(world, n, k)


_NO_BYTES = np.empty(0, dtype=np.uint8)


def _alone(flags: np.ndarray, errors: dict[int, str], extra: torch.Tensor | None) -> Verdict:
    """A group of one: the verdict ``agree`` would gather, without building a payload (its
    torch ops cost ~150 µs a batch here, a third of a one-request batch at tp=1)."""
    flags = np.asarray(flags, dtype=np.int64).reshape(1, -1)
    all_errors = [{i: clip(e) for i, e in errors.items()}] if FAILED in flags[0].tolist() else None
    table = extra.reshape(1, flags.shape[1], -1).clone() if extra is not None else None  # fresh, as gathered
    return Verdict(flags, all_errors, table)


def clip(text: str) -> str:
    """At most ERR_WIDTH bytes of UTF-8, cut on a character boundary and marked when cut."""
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) <= ERR_WIDTH:
        return raw.decode("utf-8")
    return raw[: ERR_WIDTH - len(TRUNCATED)].decode("utf-8", "ignore") + TRUNCATED


_NO_ERRORS = np.zeros(_TAIL, dtype=np.uint8)  # the tail of a rank with no failure (never written to)
_NO_ERRORS.flags.writeable = False


def _tail(errors: dict[int, str]) -> np.ndarray:
    if not errors:  # the common case: concatenate copies it into the payload
        return _NO_ERRORS
    out = np.zeros(_TAIL, dtype=np.uint8)
    out[:4] = np.frombuffer(np.int32(len(errors)).tobytes(), dtype=np.uint8)
    for k, i in enumerate(sorted(errors)[:ERR_SLOTS]):
        raw = clip(errors[i]).encode("utf-8")
        at = 4 + k * _SLOT
        out[at: at + 6] = np.frombuffer(np.int32(i).tobytes() + np.uint16(len(raw)).tobytes(), dtype=np.uint8)
        out[at + 6: at + 6 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def _read_tail(tail: np.ndarray) -> dict[int, str]:
    count = min(int(tail[:4].view(np.int32)[0]), ERR_SLOTS)
    out = {}
    for k in range(count):
        at = 4 + k * _SLOT
        i, length = int(tail[at: at + 4].view(np.int32)[0]), int(tail[at + 4: at + 6].view(np.uint16)[0])
        out[i] = tail[at + 6: at + 6 + length].tobytes().decode("utf-8")
    return out


def agree_per_request(group, flags: np.ndarray, errors: dict[int, str]) -> Verdict:
    """The reference systems' way, for bench/consensus.py: one all_gather_object per request."""
    world = group.world
    all_flags = np.zeros((world, len(flags)), dtype=np.int64)
    all_errors: list[dict[int, str]] = [{} for _ in range(world)]
    for i, f in enumerate(flags):
        for r, (flag, err) in enumerate(group.all_gather_object((int(f), errors.get(i)))):
            all_flags[r, i] = flag
            if err is not None:
                all_errors[r][i] = err
    return Verdict(all_flags, all_errors, None)
