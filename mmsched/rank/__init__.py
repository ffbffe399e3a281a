"""One rank's role, bound once at start: the ``Leader`` talks to clients and forms batches
(its parts: ``frontend``, the pure ``admission`` core, ``lifecycle``, ``status``); a
``Follower`` runs the batches the leader broadcasts. Both run the same ``BatchRunner`` on
the collective lane, so every rank takes every step in the same order.
"""

from .follower import Follower
from .leader import Leader
from .lifecycle import State

__all__ = ["Follower", "Leader", "State"]
