"""Coordinator service and client: membership, heartbeats, generations, commit vote, joins.

``recover.coord.server.Coordinator`` runs outside every worker and hosts the c10d store;
``recover.coord.client.CoordinatorClient`` is each worker's persistent connection to it.
The wire protocol (``recover.coord.protocol``) is versioned length-prefixed JSON, never pickle.
The server and a replica's relay (``recover.coord.relay``) only move bytes (``recover.coord.conn``);
their rules are pure and unit-tested: ``recover.coord.member`` (the P ranks of a replica are one member:
registers, acks, votes), ``recover.coord.ranks`` (connections, timeouts) driving ``recover.coord.state``
(membership per replica; ``integrity``: silent corruption), ``liveness`` (hangs) and ``links`` (which
link is broken, from the ``probe`` reports); on the replica's side ``generations`` keeps what the
coordinator's pushes told the client.
This package imports no torch at module level (only ``Coordinator.start`` does, for the store).
"""

from recover.coord.client import CoordinatorClient, CoordinatorLost, CoordinatorRefused, Expelled
from recover.coord.protocol import Membership
from recover.coord.server import Coordinator

__all__ = ["Coordinator", "CoordinatorClient", "CoordinatorLost", "CoordinatorRefused", "Expelled", "Membership"]
