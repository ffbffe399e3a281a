"""The tp=N launcher: it serves the ranks' rendezvous store, starts them on this host and
supervises them. If one fails, the rest get the collective timeout plus a few seconds to
notice and stop (two seconds if it was the leader: its followers serve nobody), then are
killed, and the launcher exits non-zero. Here too is the ranks' side of that bond: how a
rank learns that its launcher died.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from . import log
from .config import Config
from .log import event


def die_with_launcher(rank: int) -> None:
    """A rank started by our launcher gets a signal when the launcher dies: the leader SIGTERM
    (it drains), a follower SIGKILL until its group and engine are up (``outlive_launcher``). A follower
    ignores SIGTERM (the leader decides), so without it a follower whose launcher was killed
    during start-up retried the gone rendezvous store for a minute or more, and on a fixed
    ``dist_init`` port could meet a restarted group's."""
    parent = _launcher_pid()
    if parent is None:
        return
    sig = signal.SIGTERM if rank == 0 else signal.SIGKILL
    _set_death_signal(sig)
    if os.getppid() != parent:  # the launcher is gone already
        os.kill(os.getpid(), sig)


def outlive_launcher(rank: int) -> None:
    """A follower in a formed group stops when the leader says so (the leader drains when the
    launcher dies, and its followers must finish the batches in flight) or its group breaks."""
    if rank > 0 and _launcher_pid() is not None:
        _set_death_signal(0)


def _launcher_pid() -> int | None:
    """Our launcher's pid when it started this rank on Linux (PR_SET_PDEATHSIG is Linux's)."""
    parent = os.environ.get("MMSCHED_LAUNCHER_PID")
    return int(parent) if parent and sys.platform.startswith("linux") else None


def _set_death_signal(sig: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


def ignore_late_signals() -> None:
    """The work is done: a stop signal that arrives now (a supervisor's second SIGTERM) must
    not turn a clean exit into death by signal. Python restores the default action of its
    own handlers while it finalizes, which is slow once an engine's imports are loaded; an
    ignored signal stays ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _group_store(cfg: Config) -> tuple[dist.TCPStore, socket.socket]:
    """The group's rendezvous store, served by the launcher from a socket it bound itself
    (127.0.0.1, a port the kernel picked), with that socket: both held until the group exits.

    Choosing a free port and leaving rank 0 to bind it later left a window in which the
    port could be taken (by the local end of any outgoing connection: the kernel hands out
    the same ephemeral range), and the group would fail to start; rank 0's store also
    listened on every interface. The ranks find the store as torchrun's workers find their
    agent's (``TORCHELASTIC_USE_AGENT_STORE``): all of them as clients."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], cfg.tp, is_master=True, wait_for_workers=False,
                              master_listen_fd=sock.fileno(), timeout=timedelta(seconds=cfg.collective_timeout))
    except BaseException:
        sock.close()
        raise
    return store, sock


LEADERLESS_GRACE_S = 2.0  # followers of a leader that failed: time to notice and log it, then killed


def _grace(codes: list[int | None], collective_timeout: float) -> float:
    """Seconds the ranks still running get after the first failure, before they are killed.

    A rank that refused its config (exit 2) ran nothing: nobody to wait for. A leader that
    failed leaves followers that serve nobody (only the leader answers clients); a follower
    still starting would otherwise wait out the rendezvous timeout, 30 s by default. Else
    the leader may still be answering: it gets the collective timeout and a few seconds."""
    if 2 in codes:
        return 0.0
    if codes[0] not in (None, 0):
        return LEADERLESS_GRACE_S
    return collective_timeout + 5


def launch_group(cfg: Config, argv: list[str]) -> int:
    """Start cfg.tp rank processes of ``mmsched <argv>`` on this host and supervise them."""
    log.setup(-1, cfg.log_format, cfg.log_level, role="launcher")
    held = ()  # the launcher's store and its socket, kept until the group exits: the ranks have its port
    if cfg.dist_init:  # rank 0 serves the store on the address given
        hostport = cfg.dist_init.split("://", 1)[-1]
        host, _, port = hostport.rpartition(":")
    else:
        held = _group_store(cfg)
        host, port = "127.0.0.1", str(held[0].port)
    base = dict(os.environ, MASTER_ADDR=host, MASTER_PORT=port, WORLD_SIZE=str(cfg.tp),
                LOCAL_WORLD_SIZE=str(cfg.tp),  # every rank is on this host (cpu_affinity shares its CPUs)
                TORCHELASTIC_USE_AGENT_STORE=str(bool(held)),  # torch reads "True" alone: every rank a client
                MMSCHED_LAUNCHER_PID=str(os.getpid()))
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [subprocess.Popen([sys.executable, "-m", "mmsched", *argv],
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True)
             for r in range(cfg.tp)]
    event("launched", ranks=cfg.tp, pids=",".join(str(p.pid) for p in procs), dist=f"{host}:{port}")

    def forward(signum, _frame):  # the leader decides; a second signal means "now"
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            bad = [c for c in codes if c != 0]
            event("group_exited", codes=",".join(map(str, codes)))
            ignore_late_signals()
            return (128 - bad[0] if bad[0] < 0 else bad[0]) if bad else 0  # a rank killed by signal N: 128+N, as a shell says
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
            event("rank_exited", logging.ERROR, codes=",".join(str(c) for c in codes))
        if failed_at is not None and time.monotonic() - failed_at > _grace(codes, cfg.collective_timeout):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
