"""One replica and its step: the built-in replica (:mod:`~recover.train.replicas.replica`: model, optimizer,
data and step gradients under any PP x FSDP x TP layout) and a user's model and optimizer as one
(:mod:`~recover.train.replicas.own`, its contracts checked: :mod:`~recover.train.replicas.contract`); the end
of a step every replica shares (:mod:`~recover.train.replicas.update`), AdamW and its schedule
(:mod:`~recover.train.replicas.optim`), float16 loss scaling (:mod:`~recover.train.replicas.scaling`),
fingerprints and one-read host copies (:mod:`~recover.train.replicas.bits`), the one iterator of committed
steps (:mod:`~recover.train.replicas.steps`) and a replica's ``torch.distributed`` context with the
failure-free group and vote of ``recover train`` (:mod:`~recover.train.replicas.dist`).

Contract: a replica is what the step protocol computes on (a
:class:`~recover.recovery.interfaces.StepReplica`); this room starts no process, talks to no coordinator and
decides no checkpoint (those are :mod:`~recover.train.processes`'). It imports
:mod:`~recover.train.checkpoints` (weights for ``--init-from``, the extra state's encoding), never
:mod:`~recover.train.processes`.
"""
