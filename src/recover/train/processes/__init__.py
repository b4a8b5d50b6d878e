"""The processes that train, and their loop: the loop of committed steps shared by ``recover train`` and every
replica of ``recover launch`` (:mod:`~recover.train.processes.loop`); ``recover train``
(:mod:`~recover.train.processes.cli`, :mod:`~recover.train.processes.trainer`: the step protocol without a
coordinator, alone or under torchrun); ``recover worker`` (:mod:`~recover.train.processes.worker`); a user's
script as a launched replica (:mod:`~recover.train.processes.script`); the one start of every replica process
(:mod:`~recover.train.processes.process`) and its membership of the job (:mod:`~recover.train.processes.session`:
coordinator, fault injections, files, exit statuses); what a replica and its launcher agree on without torch
(:mod:`~recover.train.processes.exits`).

Contract: the top room of :mod:`recover.train`: it composes :mod:`~recover.train.replicas` and
:mod:`~recover.train.checkpoints` with the layers below (the step protocol, collectives, the coordinator);
no other room imports it. :mod:`~recover.train.processes.exits` imports nothing of recover, so the launcher
reads it without torch.
"""
