"""consensus.clip: what a client reads of a long or non-ASCII error (pure code)."""

from __future__ import annotations

from mmsched.consensus import ERR_WIDTH, TRUNCATED, clip


def test_short_text_is_unchanged():
    assert clip("FileNotFoundError: /dev/shm/x") == "FileNotFoundError: /dev/shm/x"
    assert clip("é" * (ERR_WIDTH // 2)) == "é" * (ERR_WIDTH // 2)  # exactly ERR_WIDTH bytes


def test_long_text_is_cut_on_a_character_boundary_with_a_marker():
    out = clip("x" + "€" * ERR_WIDTH)  # 3-byte characters: the cut falls inside one
    assert out.endswith(TRUNCATED) and len(out.encode()) <= ERR_WIDTH
    assert set(out[1: -len(TRUNCATED)]) == {"€"}


def test_a_lone_surrogate_does_not_raise():
    assert clip("OSError: bad name \udcff") == "OSError: bad name \\udcff"
