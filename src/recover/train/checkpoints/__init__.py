"""Checkpoints and weights on disk, and what reads them: DCP checkpoints visible only once complete
(:mod:`~recover.train.checkpoints.checkpoint`; a user's model's: :mod:`~recover.train.checkpoints.own_checkpoint`),
the process that writes asynchronous ones (:mod:`~recover.train.checkpoints.writer`), the commit protocol,
manifests and which are intact (:mod:`~recover.train.checkpoints.integrity`, no torch), what each
carries (:mod:`~recover.train.checkpoints.describe`), when the saving replica saves
(:mod:`~recover.train.checkpoints.cadence`), a user's extra state as tensors and JSON
(:mod:`~recover.train.checkpoints.extra`), model weights from any source and ``--init-from``
(:mod:`~recover.train.checkpoints.weights`), ``recover sample`` and ``recover export``
(:mod:`~recover.train.checkpoints.sample`, :mod:`~recover.train.checkpoints.export`, their command line:
:mod:`~recover.train.checkpoints.checkpoint_cli`).

Contract: the lowest room of :mod:`recover.train`: it imports neither :mod:`~recover.train.replicas` nor
:mod:`~recover.train.processes`. It knows a replica only by what is saved of it, Protocols the replicas
satisfy (:class:`~recover.train.checkpoints.checkpoint.Saved`,
:class:`~recover.train.checkpoints.own_checkpoint.OwnState`), so what reads a checkpoint (sample, export,
``--init-from``, the checks before a resume) needs neither a replica nor a launched job.
"""
