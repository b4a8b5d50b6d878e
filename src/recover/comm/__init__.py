"""LAYER 1: fault-tolerant collectives over membership generations (gloo on CPU, NCCL on GPU).

A failure in one data-parallel replica never crashes or hangs the others: every collective runs on a
copy, async and polled against the coordinator's failure notices, and raises
``PeerFailure(generation, dead)``; ``group.next_generation()`` then rendezvouses the survivors on a
fresh process group. ``recover.comm.transfer`` ships a joiner its state over the new group.

Typical use (one replica)::

    client = CoordinatorClient(host, port, token, replica_id)
    group = FaultTolerantGroup.create(client, client.register(), backend="auto")
    while training:
        try:
            grads = group.allreduce(local_grads)       # inputs untouched, outputs new
        except PeerFailure as failure:                 # failure.dead: replicas gone
            group = group.next_generation()            # re-plan their work, reduce again
            continue
        apply(grads)
        group.release(grads)                           # consumed: their buffers serve the next step
"""

from recover.comm.buffers import BufferPool
from recover.comm.graveyard import Graveyard
from recover.comm.group import FaultTolerantGroup
from recover.comm.reduction import plan_buckets
from recover.comm.transfer import StateTransferError, receive_state, send_state, source_rank

__all__ = ["BufferPool", "FaultTolerantGroup", "Graveyard", "StateTransferError", "plan_buckets", "receive_state",
           "send_state", "source_rank"]
