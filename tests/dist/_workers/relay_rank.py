"""One rank of a replica behind a relay, as its own process (for tests/dist/test_coord_relay.py).

Usage: ``relay_rank.py COORD_PORT TOKEN REPLICA RANK RANKS [RELAY_PORT]``. Rank 0 starts the
replica's :class:`~recover.coord.relay.Relay` and prints ``{"relay_port": ...}`` first; every rank
then registers through the relay and prints one JSON line per generation it learns
(``{"generation": g, "members": [...]}``; after the first, its commit vote for step 0), then
``{"lost": why}`` when the coordinator is gone.
"""

from __future__ import annotations

import json
import sys

from recover.coord.client import CoordinatorClient, CoordinatorLost
from recover.coord.relay import Relay


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    port, token, replica, rank, ranks = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:6])
    relay = None
    if rank == 0:
        relay = Relay("127.0.0.1", port, token, replica, ranks, heartbeat_interval_s=0.05).start()
        relay_port = relay.address[1]
        say(relay_port=relay_port)
    else:
        relay_port = int(sys.argv[6])
    client = CoordinatorClient("127.0.0.1", relay_port, token, replica, heartbeat_interval_s=0.05, rank=rank,
                               ranks=ranks)
    try:
        m = client.register(timeout=30)
        say(generation=m.generation, members=list(m.members))
        say(committed=client.vote_commit(m.generation, 0, [0, 1, 2, 3], timeout=30, mb_s=0.1 * (rank + 1)) is None,
            speeds=client.speeds)
        while True:
            m = client.wait_for_generation(m.generation, timeout=60)
            say(generation=m.generation, members=list(m.members))
    except CoordinatorLost as exc:
        say(lost=str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
