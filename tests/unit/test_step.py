"""The pure parts of a batch's step: ``decide`` (every outcome and their order), the engine
step's verdict (with in-process groups: no sockets, no processes), and ``render``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmsched.consensus import ABORTED, FAILED, Verdict
from mmsched.engine import EngineRequest
from mmsched.faults import NO_FAULTS, Fault, Faults
from mmsched.group import SoloGroup
from mmsched.step.engine_step import run_engine
from mmsched.step.outcome import ENGINE, MATERIALIZE, Aborted, Failed, Gate, Ok, Refused, decide, render


def verdict(*rank_flags: list[int], errors=None) -> Verdict:
    """A verdict as the consensus would hand it over: flags[rank][request]."""
    return Verdict(np.array(rank_flags, dtype=np.int64), errors, None)


# ---------------------------------------------------------------- decide

def test_every_outcome_in_one_batch():
    # requests: 0 aborted, 1 failed on rank 1, 2 refused, 3 digest mismatch on rank 1,
    # then survivors 4..6: aborted in the engine step, failed in it on rank 0, ok
    mat = verdict([ABORTED, 0, 0, 0, 0, 0, 0], [0, FAILED, 0, 0, 0, 0, 0],
                  errors=[{}, {1: "FileNotFoundError: gone"}])
    gate = Gate(7, mat, {2: "session full"}, [[], [], [], [1], [], [], []])
    assert gate.survivors() == [4, 5, 6]
    eng = verdict([ABORTED, FAILED, 0], [0, 0, 0], errors=[{1: "ValueError: nan"}, {}])
    out = decide(gate, eng, [None, None, {"output_ids": [1]}], [None, None, None, None, None, None, ["d"]])
    assert out == [
        Aborted(MATERIALIZE),
        Failed(MATERIALIZE, [1], "rank 1: FileNotFoundError: gone"),
        Refused("session full"),
        Failed(MATERIALIZE, [1], "rank 1: DigestMismatch: bytes differ from rank 0's"),
        Aborted(ENGINE),
        Failed(ENGINE, [0], "rank 0: ValueError: nan"),
        Ok({"output_ids": [1]}, ["d"]),
    ]


@pytest.mark.parametrize("facts, expected", [
    # aborted > failed: the leader's abort wins over a failure on another rank
    (dict(flags=[[ABORTED], [FAILED]]), Aborted(MATERIALIZE)),
    # failed > refused > mismatch
    (dict(flags=[[0], [FAILED]], refused={0: "full"}, mismatch=[[1]]), Failed(MATERIALIZE, [1], "rank 1: unknown error")),
    (dict(flags=[[0], [0]], refused={0: "full"}, mismatch=[[1]]), Refused("full")),
    # mismatch > anything the engine says (the request never reaches it)
    (dict(flags=[[0], [0]], mismatch=[[1]]), Failed(MATERIALIZE, [1], "rank 1: DigestMismatch: bytes differ from rank 0's")),
    # engine aborted > engine failed
    (dict(flags=[[0], [0]], engine=[[ABORTED], [FAILED]]), Aborted(ENGINE)),
    (dict(flags=[[0], [0]], engine=[[0], [FAILED]]), Failed(ENGINE, [1], "rank 1: unknown error")),
    (dict(flags=[[0], [0]], engine=[[0], [0]]), Ok({"x": 1}, None)),
])
def test_the_order_of_outcomes(facts, expected):
    gate = Gate(1, verdict(*facts["flags"]), facts.get("refused", {}), facts.get("mismatch", [[]]))
    eng = verdict(*facts.get("engine", [[0], [0]]))
    assert decide(gate, eng if gate.survivors() else None, [{"x": 1}], [None]) == [expected]


def test_a_batch_that_skipped_the_consensus_reports_early_aborts_as_materialize():
    gate = Gate(2, None, {}, [[], []])
    assert gate.survivors() == [0, 1]
    eng = verdict([ABORTED, ABORTED])
    assert decide(gate, eng, [None, None], [None, None], early_aborts=frozenset({0})) == [
        Aborted(MATERIALIZE), Aborted(ENGINE)]


def test_render_keeps_the_result_format():
    assert render("r", Ok({"output_ids": [3]}, ["ab"]), 2)["meta"] == {"ranks": 2, "digests": ["ab"]}
    assert render("r", Ok({}, None), 1)["meta"] == {"ranks": 1}
    failed = render("r", Failed(ENGINE, [1], "rank 1: ValueError: x"), 2)
    assert (failed["status"], failed["message"], failed["meta"]) == (
        500, "Engine step failed (rank 1: ValueError: x)", {"failed_ranks": [1], "stage": "engine"})
    failed = render("r", Failed(MATERIALIZE, [0], "rank 0: E: y"), 2)
    assert failed["message"] == "Multimodal feature reconstruction failed (rank 0: E: y)"
    assert render("r", Aborted(ENGINE), 2)["status"] == 499
    assert render("r", Refused("full"), 2)["status"] == 503


# ---------------------------------------------------------------- the engine step's verdict

def requests(*rids: str) -> list[EngineRequest]:
    return [EngineRequest(rid, "generate", np.arange(3, dtype=np.int64), [], [], 2, {}) for rid in rids]


class Engine:
    def __init__(self, outs=None, raises=None):
        self.outs, self.raises, self.seen = outs, raises, None

    def step(self, reqs):
        self.seen = [r.rid for r in reqs]
        if self.raises:
            raise self.raises
        return self.outs if self.outs is not None else [{"ok": r.rid} for r in reqs]


class Mirror(SoloGroup):
    """Two ranks in one process, the second gathering exactly what the first does (so every
    failure is named on both), every collective counted: a group of one has none to count."""

    world = 2

    def __init__(self):
        self.calls = 0

    def all_gather(self, payload):
        self.calls += 1
        return np.stack([payload, payload])

    def all_gather_object(self, obj):
        self.calls += 1
        return [obj, obj]


def both(error: str) -> str:
    """The message of a failure both ranks of a ``Mirror`` report."""
    return f"rank 0: {error}; rank 1: {error}"


def step(engine, rids=("a", "b", "c"), faults=NO_FAULTS, aborted=dict):
    return run_engine(SoloGroup(), engine, faults, 0.0, requests(*rids), aborted)


def test_a_per_request_exception_fails_that_request_only():
    s = step(Engine([{"o": 1}, ValueError("bad row"), {"o": 3}]))
    assert [s.verdict.ok(j) for j in range(3)] == [True, False, True]
    assert s.verdict.message(1) == "rank 0: ValueError: bad row"
    assert s.outputs == [{"o": 1}, None, {"o": 3}] and s.failures == 1


def test_a_raising_step_fails_every_request_with_its_error():
    s = step(Engine(raises=RuntimeError("out of memory")))
    assert s.failures == 3 and all(s.verdict.message(j) == "rank 0: RuntimeError: out of memory" for j in range(3))


def test_a_wrong_return_is_an_engine_failure_not_a_crash():
    s = step(Engine([{"o": 1}]))  # one output for three requests
    assert s.failures == 3 and "3 requests" in s.verdict.message(0)
    s = step(Engine([{"o": 1}, None, {"o": 3}]))
    assert [s.verdict.ok(j) for j in range(3)] == [True, False, True]
    assert "TypeError" in s.verdict.message(1)


def test_the_engine_drill_is_injected_by_the_runner():
    engine = Engine()
    s = step(engine, faults=Faults([Fault.parse("0:engine:b")], 0))
    assert engine.seen == ["a", "b", "c"], "the engine still sees every request"
    assert s.verdict.message(1) == "rank 0: InjectedFault: injected engine fault on rank 0"
    assert [s.verdict.ok(j) for j in range(3)] == [True, False, True]


def test_late_aborts_are_agreed_after_the_step_and_an_early_one_wins_over_a_failure():
    s = step(Engine([ValueError("x"), ValueError("y"), {"o": 3}]),
             aborted=lambda: {0: "early", 1: "late", 2: "late"})
    assert [s.verdict.aborted(j) for j in range(3)] == [True, False, True]
    assert s.verdict.failed_ranks(1) == [0]  # a late abort does not hide a failure
    assert s.outputs == [None, None, None]


def test_the_agreement_is_one_collective_failures_included():
    group = Mirror()
    run_engine(group, Engine(), NO_FAULTS, 0.0, requests("a"), dict)
    assert group.calls == 1
    s = run_engine(group, Engine([ValueError("x")]), NO_FAULTS, 0.0, requests("a"), dict)
    assert group.calls == 2 and s.verdict.message(0) == both("ValueError: x")  # the string rode in the flags'


def test_a_group_of_one_agrees_without_a_collective_and_gives_the_same_verdict():
    from mmsched import consensus

    class Counting(SoloGroup):
        calls = 0

        def all_gather(self, payload):
            self.calls += 1
            return super().all_gather(payload)

    flags, errors, extra = np.array([0, 1, 2, 1, 1, 1, 1]), {k: f"E: {k}" for k in (1, 3, 4, 5, 6)}, torch.ones(7, 2)
    alone = consensus.agree(Counting(), flags, errors | {6: "E: " + "é" * 300}, extra=extra)
    assert alone.extra.shape == (1, 7, 2) and alone.extra.data_ptr() != extra.data_ptr()  # fresh, as gathered
    assert [alone.ok(i) for i in range(7)] == [True] + [False] * 6 and alone.aborted(2)
    assert alone.message(1) == "rank 0: E: 1" and alone.message(6).endswith(consensus.TRUNCATED)
    assert len(alone.message(6).encode()) <= len("rank 0: ") + consensus.ERR_WIDTH
    assert consensus.agree(Counting(), np.zeros(2), {}).errors is None


# ---------------------------------------------------------------- what a plug-in engine can get wrong
# (found by an outside attack on the plug-in contract: each one ended the leader's loop or
# broke the group, or changed what a session's later turns read)

def test_an_output_messagepack_cannot_carry_fails_that_request_only():
    import torch

    s = step(Engine([{"o": torch.zeros(2)}, {"o": {1, 2}}, {"o": 3}]))
    assert [s.verdict.ok(j) for j in range(3)] == [False, False, True]
    assert s.verdict.message(0).startswith("rank 0: TypeError: engine output cannot be sent as MessagePack")
    assert s.outputs == [None, None, {"o": 3}]


def nested(levels: int) -> dict:
    out = {"leaf": 1}
    for _ in range(levels):
        out = {"d": out}
    return out


def replies(output) -> bool:
    """Whether a 200 carrying this output encodes, and decodes as the client library decodes."""
    import msgpack

    from mmsched.protocol import pack, result

    try:
        msgpack.unpackb(pack(result("r", 200, output=output)), raw=False, strict_map_key=True)
    except (ValueError, TypeError):
        return False
    return True


def test_an_output_a_client_cannot_read_is_that_requests_500_not_a_200_it_never_gets():
    """From an outside attack: a map with an int key went out as a 200 that a strict decoder
    (the client library's) drops, and an output nested one level short of the encoder's
    limit passed the check but not the reply (a meta-less 500, after a session had stored)."""
    deepest = next(n for n in range(900, 1100) if not replies(nested(n))) - 1
    bad, good = [{"o": 1, 2: "two"}, nested(deepest + 1)], [nested(deepest), {"o": 3}]
    assert not any(map(replies, bad)) and all(map(replies, good))
    s = step(Engine(bad + good), rids=("a", "b", "c", "d"))
    assert [s.verdict.ok(i) for i in range(4)] == [False, False, True, True]
    assert all("cannot be sent as MessagePack" in s.verdict.message(i) for i in (0, 1))
    assert s.outputs[2:] == good
    for out in bad:  # alone in its batch, where the one-pass check is the whole check
        alone = step(Engine([out]), rids=("a",))
        assert not alone.verdict.ok(0) and "cannot be sent as MessagePack" in alone.verdict.message(0)


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str exploded")


class NotAString(Exception):
    def __str__(self):
        return 42  # noqa: PLE0307 - what a careless engine does


@pytest.mark.parametrize("exc", [Unprintable(), NotAString()])
def test_an_exception_that_cannot_say_what_it_is_still_names_its_type(exc):
    s = step(Engine([exc, {"o": 2}]), rids=("a", "b"))
    assert s.verdict.message(0) == f"rank 0: {type(exc).__name__}: <unprintable message>"
    assert s.verdict.ok(1)


def test_a_feature_a_session_keeps_reaches_the_engine_as_a_copy():
    import torch

    from mmsched.protocol import Item, Request
    from mmsched.step.engine_step import engine_requests

    kept, passing = torch.arange(4, dtype=torch.uint8), torch.arange(4, dtype=torch.uint8)
    items = [Item(index=0, modality="image", transport="inline", dtype="uint8", shape=(4,), nbytes=4, id="img"),
             Item(index=1, modality="image", transport="session", dtype="uint8", shape=(4,), nbytes=4, ref="img"),
             Item(index=2, modality="image", transport="inline", dtype="uint8", shape=(4,), nbytes=4)]
    req = Request(rid="r", type="embed", input_ids=np.array([1]), items=items, session_id="s")
    [got] = engine_requests([req], [[kept, kept, passing]], [0])
    for t in got.features:
        t.fill_(9)  # an engine that writes into its input
    assert kept.tolist() == [0, 1, 2, 3]  # what the session stores and later turns read
    assert passing.tolist() == [9, 9, 9, 9]  # a feature nobody keeps is not copied


def test_a_result_that_cannot_be_encoded_is_a_500_not_the_end_of_the_loop():
    import msgpack

    from mmsched.protocol import OK, result
    from mmsched.rank.frontend import _packed

    sent = msgpack.unpackb(_packed(result("r1", OK, output={"o": {1, 2}})), raw=False)
    assert (sent["rid"], sent["status"]) == ("r1", 500)
    assert sent["message"].startswith("result could not be encoded: TypeError")


# ---------------------------------------------------------------- EngineContext.gather: the agreement rides in it

class Gathering:
    """An engine whose step has one gather, as a tensor-parallel model's does: it names the
    rows it failed in the gather, and may fail one more after it (``after``)."""

    def __init__(self, gather, failed=None, after=None):
        self.gather, self.failed, self.after, self.gathered = gather, failed or {}, after or {}, None

    def step(self, reqs):
        import torch

        local = torch.arange(len(reqs) * 2, dtype=torch.float64).reshape(len(reqs), 2)
        self.gathered = self.gather(local, self.failed)
        return [self.failed.get(j) or self.after.get(j) or {"o": float(self.gathered[0, j, 1])}
                for j in range(len(reqs))]


def gathered_step(engine_of, rids=("a", "b", "c"), faults=NO_FAULTS, aborted=dict):
    from mmsched.step.engine_step import FlaggedGather

    group = Mirror()
    gather = FlaggedGather(group, faults, 0.0)
    engine = engine_of(gather)
    s = run_engine(group, engine, faults, 0.0, requests(*rids), aborted, gather)
    return s, group.calls, engine


def test_an_engine_that_gathers_through_the_context_pays_no_agreement_of_its_own():
    s, calls, engine = gathered_step(lambda g: Gathering(g, failed={1: ValueError("bad row")}))
    assert calls == 1, "the engine's gather is the only collective: the agreement rode in it"
    assert tuple(engine.gathered.shape) == (2, 3, 2) and engine.gathered[1, 2, 1] == 5.0  # its rows, intact
    assert [s.verdict.ok(j) for j in range(3)] == [True, False, True]
    assert s.verdict.message(1) == both("ValueError: bad row")
    assert s.outputs == [{"o": 1.0}, None, {"o": 5.0}] and s.agree_s >= 0 and s.failures == 1


def test_the_gather_lets_go_of_a_steps_features_once_the_step_is_over():
    """Outside attack: after four 1 GiB features each rank stayed at 4.3 GiB while idle, until
    the next request came: the armed gather still held the last step's requests."""
    import gc
    import weakref

    from mmsched.step.engine_step import FlaggedGather

    group = Mirror()
    gather = FlaggedGather(group, NO_FAULTS, 0.0)
    reqs = requests("a", "b")
    feature = torch.zeros(1 << 20, dtype=torch.uint8)
    reqs[0].features.append(feature)
    gone = weakref.ref(feature)
    s = run_engine(group, Gathering(gather), NO_FAULTS, 0.0, reqs, dict, gather)
    assert s.verdict.ok(0) and s.verdict.ok(1)
    del feature, reqs
    gc.collect()
    assert gone() is None, "the step is over, yet its feature is still held"


def test_a_row_the_engine_names_with_no_error_is_not_failed():
    """``failed`` maps rows to errors: a row mapped to None failed nothing (as before the
    failures and drills were folded into one pass)."""
    s, _, _ = gathered_step(lambda g: Gathering(g, failed={0: None, 2: ValueError("bad row")}))
    assert [s.verdict.ok(j) for j in range(3)] == [True, True, False]
    assert s.outputs[:2] == [{"o": 1.0}, {"o": 3.0}] and s.failures == 1


def test_drills_and_aborts_ride_in_the_engines_gather():
    s, calls, _ = gathered_step(Gathering, faults=Faults([Fault.parse("0:engine:b")], 0),
                                aborted=lambda: {2: "late"})
    assert calls == 1
    assert s.verdict.message(1) == both("InjectedFault: injected engine fault on rank 0")
    assert s.verdict.aborted(2) and s.outputs == [{"o": 1.0}, None, None]


def test_a_failure_after_the_engines_gather_is_a_500_of_rank_0_and_the_session_still_agrees():
    s, _, _ = gathered_step(lambda g: Gathering(g, after={0: RuntimeError("late")}))
    assert s.verdict.ok(0), "every rank agreed it ran: sessions keep it everywhere"
    assert s.late == {0: "rank 0: RuntimeError: late"} and s.outputs[0] is None and s.failures == 1
    [first, second] = decide(Gate(2, None, {}, [[], []]), s.verdict, s.outputs, [None, None], late=s.late)[:2]
    assert first == Failed(ENGINE, [0], "rank 0: RuntimeError: late", agreed_ok=True) and isinstance(second, Ok)
    assert render("a", first, 2)["message"] == "Engine step failed (rank 0: RuntimeError: late)"


class Twice(Gathering):
    """A step with two gathers (a model gathering per layer or per token)."""

    def step(self, reqs):
        self.gather(torch.zeros(len(reqs), 1, dtype=torch.float64))
        return super().step(reqs)


def test_the_step_says_once_when_its_agreement_is_in_and_not_before():
    from mmsched.step.engine_step import FlaggedGather

    events = []
    group = Mirror()
    real = group.all_gather
    group.all_gather = lambda payload: (events.append("gather"), real(payload))[1]
    gather = FlaggedGather(group, NO_FAULTS, 0.0)
    s = run_engine(group, Twice(gather), NO_FAULTS, 0.0, requests("a", "b"), dict, gather,
                   agreed=lambda: events.append("agreed"))
    assert events == ["gather", "agreed", "gather"] and s.verdict.ok(0) and s.verdict.ok(1)
    events.clear()  # an engine that does not gather: after the runner's own agreement
    run_engine(group, Engine(), NO_FAULTS, 0.0, requests("a"), dict, agreed=lambda: events.append("agreed"))
    assert events == ["gather", "agreed"]


def test_a_failure_to_publish_after_the_agreement_breaks_the_step_even_if_the_engine_swallows_it():
    from mmsched.errors import GroupBroken
    from mmsched.step.engine_step import FlaggedGather

    class Swallowing(Gathering):
        def step(self, reqs):
            try:
                return super().step(reqs)
            except Exception:  # an engine that catches everything its step raises
                return [{"o": 0.0} for _ in reqs]

    def publish():
        raise GroupBroken("ring: follower 1 is gone")

    group = Mirror()
    gather = FlaggedGather(group, NO_FAULTS, 0.0)
    with pytest.raises(GroupBroken, match="follower 1 is gone"):
        run_engine(group, Swallowing(gather), NO_FAULTS, 0.0, requests("a"), dict, gather, publish)
    s = run_engine(group, Gathering(gather), NO_FAULTS, 0.0, requests("a"), dict, gather)
    assert s.outputs == [{"o": 1.0}]  # the next step starts clean


@pytest.mark.parametrize("fails_at", [1, 2])
def test_a_gather_whose_collective_failed_breaks_the_step_even_if_the_engine_swallows_it(fails_at):
    """Outside attack (session 55): an engine that caught the error of a failed gather (its
    group's timeout shortened, a peer in another call) and returned was answered 200 by an
    earlier call's verdict, or by the runner's own agreement, with its peers out of step."""
    from mmsched.errors import GroupBroken
    from mmsched.step.engine_step import FlaggedGather

    class Failing(Mirror):
        def all_gather(self, payload):
            if self.calls + 1 == fails_at:
                self.calls += 1
                raise GroupBroken("all_gather failed: Timed out waiting 500ms")
            return super().all_gather(payload)

    class Swallowing(Twice):
        def step(self, reqs):
            try:
                return super().step(reqs)
            except GroupBroken:  # an engine returning per-request errors, as the docs advise
                return [ValueError("gather failed") for _ in reqs]

    group = Failing()
    gather = FlaggedGather(group, NO_FAULTS, 0.0)
    with pytest.raises(GroupBroken, match=r"EngineContext.gather failed on rank 0 \(GroupBroken: all_gather failed"):
        run_engine(group, Swallowing(gather), NO_FAULTS, 0.0, requests("a"), dict, gather)
    assert group.calls == fails_at, "no agreement of the runner's own after the failed gather"
    s = run_engine(group, Gathering(gather), NO_FAULTS, 0.0, requests("a"), dict, gather)
    assert s.outputs == [{"o": 1.0}], "the next step starts clean"


@pytest.mark.parametrize("rows", ["sparse", "meta"])
def test_rows_the_gather_cannot_send_are_refused_before_the_call_counts(rows):
    """Outside attack (session 55): a sparse or meta tensor (a CUDA one likewise) failed inside
    the collective's preparation and was taken for a failed collective: an engine that caught
    it and gathered dense rows had its step break the group. It is the caller's mistake, said
    before anything is sent; the call does not count, so the next one pairs with the peers'."""
    from mmsched.step.engine_step import FlaggedGather

    class Retrying(Gathering):
        def step(self, reqs):
            bad = torch.zeros(len(reqs), 2).to_sparse() if rows == "sparse" else torch.zeros(len(reqs), 2, device="meta")
            try:
                self.gather(bad)
            except ValueError as exc:
                self.refused = str(exc)
            return super().step(reqs)

    group = Mirror()
    gather = FlaggedGather(group, NO_FAULTS, 0.0)
    engine = Retrying(gather)
    s = run_engine(group, engine, NO_FAULTS, 0.0, requests("a", "b"), dict, gather)
    assert "rows must be a dense CPU tensor" in engine.refused and "local.cpu()" in engine.refused
    assert s.outputs == [{"o": 1.0}, {"o": 3.0}] and (gather.calls, group.calls) == (1, 1)


def test_a_step_that_does_not_gather_is_agreed_after_it_and_the_gather_refuses_misuse():
    import torch

    s, calls, _ = gathered_step(lambda g: Engine([{"o": 1}, ValueError("x"), {"o": 3}]))
    assert calls == 1 and s.agree_s is not None and s.verdict.message(1) == both("ValueError: x")
    from mmsched.step.engine_step import FlaggedGather

    gather = FlaggedGather(SoloGroup(), NO_FAULTS, 0.0)
    with pytest.raises(RuntimeError, match="inside step"):
        gather(torch.zeros(1, 1))
    s, _, _ = gathered_step(lambda g: Gathering(lambda local, failed: g(local[:1], failed)))
    assert not any(s.verdict.ok(j) for j in range(3)) and "not one row per request" in s.verdict.message(0)


def test_the_gather_takes_calls_from_the_steps_own_thread_only_and_keeps_earlier_failures():
    import threading

    import torch

    from mmsched.step.engine_step import _named_failures

    seen = {}

    class FromAThread:
        def __init__(self, gather):
            self.gather = gather

        def step(self, reqs):
            def other():
                try:
                    self.gather(torch.zeros(len(reqs), 1))
                except RuntimeError as exc:
                    seen["error"] = str(exc)
            t = threading.Thread(target=other)
            t.start()
            t.join()
            self.gather(torch.zeros(len(reqs), 1), {0: ValueError("first")})
            self.gather(torch.zeros(len(reqs), 1), {})  # a later call does not forget row 0
            return [{"o": 1}] * len(reqs)

    s, calls, _ = gathered_step(FromAThread, rids=("a", "b"))
    assert "on step's own thread" in seen["error"] and calls == 2
    assert s.verdict.message(0) == both("ValueError: first") and s.verdict.ok(1)
    assert _named_failures({1: "x"}, 2) == {1: "x"} and _named_failures(None, 2) == {}
    for bad in ([0], {"0": ValueError()}, {True: ValueError()}, {2: ValueError()}, {-1: ValueError()}):
        assert set(_named_failures(bad, 2)) == {0, 1}, bad  # every row, not a silent 200


def test_a_gather_whose_peer_is_at_another_step_or_call_is_a_broken_group():
    import torch

    from mmsched import consensus
    from mmsched.errors import GroupBroken

    class Skewed(SoloGroup):
        """Two ranks, the second one gather behind: its stamp's call is one less."""
        world = 2

        def all_gather(self, payload):
            other = payload.copy()
            other[8:16] = np.array([int(payload[8:16].view(np.int64)[0]) - 1]).view(np.uint8)
            return np.stack([payload, other])

    with pytest.raises(GroupBroken, match=r"out of step.*\[\[3, 2\], \[3, 1\]\]"):
        consensus.agree(Skewed(), np.zeros(2, dtype=np.int64), {}, extra=torch.zeros(2, 1), stamp=(3, 2))
    v = consensus.agree(SoloGroup(), np.array([0, 1]), {1: "E: x"}, extra=torch.ones(2, 1), stamp=(3, 2))
    assert v.failed_ranks(1) == [0] and v.message(1) == "rank 0: E: x" and v.extra.shape == (1, 2, 1)
