"""Training: the replica (:mod:`~recover.train.replica`), the loop of committed steps (:mod:`~recover.train.loop`),
``recover train`` (:mod:`~recover.train.trainer`), the replica worker of ``recover launch``
(:mod:`~recover.train.worker`), the optimizer, checkpoints and torchrun set-up."""
