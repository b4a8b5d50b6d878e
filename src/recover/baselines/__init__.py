"""Baselines that `recover` is measured against, run on the same model, data and failures.

- ``shrink``: shrink-and-drop, the semantics of torchft's fault-tolerant DDP: a step in which a
  replica fails is discarded, and training continues with the survivors' own local batches, so the
  global batch shrinks (labelled as our implementation of those semantics, not torchft itself).
- ``restart``: checkpoint-and-restart, the way most jobs run today: any failure stops the whole
  job, which is relaunched (new processes, new rendezvous) from the last complete checkpoint with
  the surviving replicas, keeping M by gradient accumulation, and redoes the lost steps.

The names come from :class:`recover.names.Baseline`.
"""

from recover.baselines.steps import JobFailed, ShrinkStep, StopOnFailureStep, step_class

__all__ = ["JobFailed", "ShrinkStep", "StopOnFailureStep", "step_class"]
