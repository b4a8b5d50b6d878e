"""Coordinator service and client: membership, heartbeats, generations, commit vote, joins.

``recover.coord.server.Coordinator`` runs outside every worker and hosts the c10d store;
``recover.coord.client.CoordinatorClient`` is each worker's persistent connection to it.
The wire protocol (``recover.coord.protocol``) is versioned length-prefixed JSON, never pickle.
The server only moves bytes; its rules are pure and unit-tested: ``recover.coord.ranks`` (connections,
timeouts, aggregation of a replica's ranks) drives ``recover.coord.state`` (membership per replica).
This package imports no torch at module level (only ``Coordinator.start`` does, for the store).
"""

from recover.coord.client import CoordinatorClient, CoordinatorLost, CoordinatorRefused, Expelled
from recover.coord.protocol import Membership
from recover.coord.server import Coordinator

__all__ = ["Coordinator", "CoordinatorClient", "CoordinatorLost", "CoordinatorRefused", "Expelled", "Membership"]
