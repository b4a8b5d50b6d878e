"""What every architecture shares: the language-model loss and the name-seeded parameter draw.

Contract:
- :func:`lm_loss` is the loss recover trains every model with (the replica, the pipeline's last
  stage, evaluation): mean next-token cross-entropy over all B x T positions of one microbatch.
- :func:`param_seed` is the seed of one parameter's generator from the run seed and the parameter's
  fully qualified name, so a model's ``init_weights(seed)`` gives a pipeline stage or a shard the
  values of the whole model (:mod:`recover.model.spec`'s contract).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a parameter's fully qualified name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B x T positions of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
