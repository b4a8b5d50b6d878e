"""Training, in three rooms (subpackages), lowest first; a room imports only the rooms listed before it
(README's Layout states the order, ``tests/unit/test_imports.py`` checks it):

- :mod:`~recover.train.checkpoints`: checkpoints and weights on disk, and what reads them (``recover sample``,
  ``recover export``, ``--init-from``); a replica is known there only by the Protocol of what is saved;
- :mod:`~recover.train.replicas`: one replica and its step (the built-in :mod:`~recover.train.replicas.replica`
  and a user's model, :mod:`~recover.train.replicas.own`), the update, the optimizer and the one iterator of
  committed steps;
- :mod:`~recover.train.processes`: the processes that train and their loop (:mod:`~recover.train.processes.loop`):
  ``recover train`` (:mod:`~recover.train.processes.trainer`), the replica worker of ``recover launch``
  (:mod:`~recover.train.processes.worker`), a user's script as a launched replica, and their exit statuses.

Neither this package nor a room imports anything on its own: ``recover.train.processes.exits`` stays free of
torch for the launcher.
"""
