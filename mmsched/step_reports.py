"""Followers that the batch ring does not reach tell the leader their engine step is over, by a gloo message.

Why: rank 0 answers a step agreed in its last ``ctx.gather``, and cannot know a follower will
gather once more (an engine out of step): a failure named only in that extra call would be
missed and a 200 sent. Followers on the leader's host say so through a word of the batch ring
(``Ring.report_step``); ranks on other hosts, and every follower when the ring is off, send
the step's number here, and the leader receives one from each before it answers. A follower
still in a call never sends: the leader's lane passes its deadline (or gloo's timeout) and the
group breaks, the step's requests 500s.

The leader posts its receives before the engine runs (``begin``). Posted as it came to wait,
each report cost the step ~0.7-0.9 ms here (tp=2, ``--no-batch-ring``, plain client: p50 at
1000 req/s 1.01 -> 1.71 and 1.09 -> 1.99 ms); posted early, nothing above the noise (1.06 against 1.01 ms, and
2.59 against 2.62 ms at 6000 req/s). On two hosts (tests/integration/test_multihost.py's
layout) ~0.1 ms a batch: one request at a time, p50 1.20 against 1.10 ms.
"""

from __future__ import annotations

import torch

from .errors import GroupBroken

TAG = 0x5354  # the reports' point-to-point tag (gloo keeps it apart from collectives' slots)


class StepReports:
    def __init__(self, pg, me: int, followers: list[int]):
        """``pg``: a gloo group of the leader (its rank 0) and ``followers`` (global ranks: its
        ranks 1, 2, ... in order); ``me``: this rank's place in ``pg``."""
        self.pg, self.me, self.followers = pg, me, followers
        self._words = [torch.zeros(1, dtype=torch.int64) for _ in range(len(followers) if me == 0 else 1)]
        self._posted: list | None = None  # the leader's receives, posted and not yet waited for

    def begin(self) -> None:
        """Leader, before a step: each follower's next report may land at once (posted once,
        until a step waits for it: a step whose agreement came after it waits for none)."""
        if self.me == 0 and self._posted is None and self.followers:
            self._posted = _broken_if_raised(
                lambda: [self.pg.recv([w], src, TAG) for src, w in enumerate(self._words, start=1)],
                "posting the step reports")

    def done(self, steps: int) -> None:
        """Step ``steps`` is over here: a follower says so; the leader waits for every follower."""
        if self.me:
            self._words[0][0] = steps
            _broken_if_raised(lambda: self.pg.send(self._words, 0, TAG).wait(), f"the end of engine step {steps}")
            return
        self.begin()
        posted, self._posted = self._posted or [], None
        for work, word, rank in zip(posted, self._words, self.followers):
            _broken_if_raised(work.wait, f"rank {rank}'s end of engine step {steps}")
            if int(word[0]) != steps:
                raise GroupBroken(f"rank {rank} ended engine step {int(word[0])} where rank 0 ended {steps}")


def _broken_if_raised(call, what: str):
    try:
        return call()
    except RuntimeError as exc:  # gloo: a peer gone, or the group's timeout passed
        raise GroupBroken(f"{what}: {exc}") from exc
