"""What a rank's descriptors must hold room for, reserved at start.

Running out mid-batch would break the group, and a listener out of descriptors makes
libzmq's I/O thread spin a core on the accept it cannot make (measured: 100% of a core
until a descriptor frees). So a rank refuses a config its hard RLIMIT_NOFILE cannot
hold, raises its soft limit to the hard one, and the leader keeps client connections
to what that limit leaves (``connections_at_most``; ``rank.connections``).
"""

from __future__ import annotations

import resource

from .config import Config
from .errors import ConfigError

FD_RESERVE = 1024  # sockets, gloo, shared libraries, the pool and ack-board caches
CONNECTIONS_AT_LEAST = 256  # the leader refuses to start with room for fewer client connections


def open_items_at_most(cfg: Config) -> int:
    """Items a rank may have open at once: a batch's, and admission holds the items of
    queued and running requests to max_queued_items (a request of more is a 400)."""
    return min(cfg.max_batch * cfg.max_items, cfg.max_queued_items)


def _held(cfg: Config, rank: int) -> int:
    """Descriptors a rank may hold apart from client connections: the items it has open,
    at the leader one lock per queued item too, and the reserve."""
    return open_items_at_most(cfg) + (cfg.max_queued_items if rank == 0 else 0) + FD_RESERVE


def reserve_descriptors(cfg: Config, rank: int) -> int:
    """Refuse a config the hard RLIMIT_NOFILE cannot hold (with, at the leader, room for
    CONNECTIONS_AT_LEAST clients) and raise the soft limit to the hard one: what it leaves
    beyond the need is the leader's room for client connections. Returns the need."""
    need = _held(cfg, rank) + (CONNECTIONS_AT_LEAST if rank == 0 else 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(f"max_queued_items: rank {rank} may need {need} descriptors "
                          f"(min(max_batch x max_items, max_queued_items)"
                          f"{' + max_queued_items' if rank == 0 else ''} + {FD_RESERVE}"
                          f"{f' + {CONNECTIONS_AT_LEAST} client connections' if rank == 0 else ''}), "
                          f"RLIMIT_NOFILE allows {hard}; raise `ulimit -n` or lower max_queued_items, "
                          "max_batch or max_items")
    want = need if hard == resource.RLIM_INFINITY else hard  # (an infinite soft limit is refused for files)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return need


def connections_at_most(cfg: Config) -> int:
    """Client connections the leader keeps open: what its soft RLIMIT_NOFILE (as raised by
    ``reserve_descriptors``) leaves beyond everything else it may hold."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(soft - _held(cfg, 0), 0)
