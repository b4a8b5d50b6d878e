"""Pipeline parallelism: the model split into stages, GPipe / 1F1B schedules per microbatch count.

Contract:
- :func:`split_stage` keeps one stage's blocks (contiguous, :meth:`ParallelDims.stage_layers`), the
  modules the model's spec names ``first_stage`` (the embedding) on the first stage and ``last_stage``
  (the final norm, the output projection) on the last (:class:`~recover.model.spec.ModelSpec`);
  parameter names are unchanged, so the stage holds exactly the values of the whole model. Between
  stages flows one hidden-state tensor ``(B, T, dim)``.
- :class:`PipelineRunner` runs ``n`` microbatches of one pipeline (the stages of one
  (fsdp, tp) coordinate) through a schedule built for that ``n`` and cached by ``(n, B, T)``:
  a replica's quota changes from step to step after failures, so schedules are built on demand.
  1F1B needs ``n >= pp``; below that the runner uses GPipe (the same gradients, more memory).
- Microbatch identity flows through the schedule: row ``k`` of the stacked batch is microbatch
  position ``k`` and its target carries ``k`` in column 0, so the last stage's loss function knows
  which position it is computing, records that microbatch's MEAN loss and scales it by the
  position's weight (1, or 0 for a zero-weight padding pass). ``scale_grads=False``: a stage's
  ``.grad`` is the plain SUM over positions of d(weight * mean loss)/d(params).
- Stage metadata is static (shapes given up front), so the schedule never runs a hidden
  forward/backward for shape inference that would touch gradients or call the loss function.
- All stages of a pipeline must call :meth:`PipelineRunner.run` with the same ``n``, ``B``, ``T``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from recover.model.common import lm_loss
from recover.model.spec import spec_of
from recover.parallel.dims import ParallelDims

SCHEDULES = ("gpipe", "1f1b")


def split_stage(model: nn.Module, dims: ParallelDims, stage: int) -> nn.Module:
    """Removes from ``model`` (in place) everything that pipeline ``stage`` does not hold; returns it."""
    spec = spec_of(model)
    blocks = spec.block_dict(model)
    keep = {str(i) for i in dims.stage_layers(len(blocks), stage)}
    for key in list(blocks.keys()):
        if key not in keep:
            del blocks[key]
    drop = (spec.first_stage if stage != 0 else ()) + (spec.last_stage if stage != dims.pp - 1 else ())
    for name in drop:
        setattr(model, name, None)
    return model


class PipelineRunner:
    """This rank's stage of one pipeline and its schedules.

    Args:
        module: the stage (already tensor-parallel / sharded as wanted).
        stage: its index, ``0..num_stages-1``.
        num_stages: ``pp``.
        group: the pipeline group (this rank's ``pp`` mesh axis, bounded timeout).
        device: where activations live.
        dim: the model width (hidden states are ``(B, T, dim)``).
        vocab_size: the logits' last dimension (last stage).
        schedule: ``"1f1b"`` or ``"gpipe"``.
    """

    def __init__(self, module: nn.Module, stage: int, num_stages: int, group: dist.ProcessGroup,
                 device: torch.device, dim: int, vocab_size: int, schedule: str = "1f1b") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of {SCHEDULES}")
        self.module, self.stage, self.num_stages, self.group = module, stage, num_stages, group
        self.device, self.dim, self.vocab_size, self.schedule = device, dim, vocab_size, schedule
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._cache: dict[tuple[int, int, int], ScheduleGPipe | Schedule1F1B] = {}
        self._weights: list[float] = []
        self._losses: dict[int, float] = {}

    def kind(self, n: int) -> str:
        """The schedule used for ``n`` microbatches."""
        return "1f1b" if self.schedule == "1f1b" and n >= self.num_stages else "gpipe"

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One microbatch's loss: ``target[:, 0]`` is its position, ``target[:, 1:]`` the token ids."""
        k = int(target[0, 0])
        loss = lm_loss(logits, target[:, 1:])  # mean over B x T
        self._losses[k] = float(loss.detach())
        return loss * self._weights[k]

    def _example(self, B: int, T: int, first: bool) -> torch.Tensor:
        if first:
            return torch.zeros(B, T, dtype=torch.long, device=self.device)
        return torch.empty(B, T, self.dim, device=self.device, requires_grad=True)

    def _get(self, n: int, B: int, T: int) -> ScheduleGPipe | Schedule1F1B:
        key = (n, B, T)
        if key not in self._cache:
            # requires_grad on the examples is what makes the stages exchange activation gradients
            out = (torch.empty(B, T, self.vocab_size, device=self.device) if self.is_last
                   else torch.empty(B, T, self.dim, device=self.device, requires_grad=True))
            stage = PipelineStage(self.module, self.stage, self.num_stages, self.device,
                                  input_args=(self._example(B, T, self.is_first),), output_args=(out,),
                                  group=self.group)
            cls = Schedule1F1B if self.kind(n) == "1f1b" else ScheduleGPipe
            self._cache[key] = cls(stage, n_microbatches=n, loss_fn=self._loss, scale_grads=False)
        return self._cache[key]

    def run(self, n: int, B: int, T: int, inputs: torch.Tensor | None, targets: torch.Tensor | None,
            weights: list[float]) -> dict[int, float]:
        """Forward and backward of ``n`` stacked microbatches; grads accumulate in the stage's ``.grad``.

        Args:
            n: microbatches (positions) in this run.
            B, T: rows and tokens of one microbatch.
            inputs: ``(n*B, T)`` token ids on the first stage, else ignored.
            targets: ``(n*B, T)`` next-token ids on the last stage, else ignored.
            weights: one weight per position (0 for a padding pass).

        Returns:
            On the last stage ``{position: mean loss}`` for every position; elsewhere ``{}``.
        """
        if n < 1:
            return {}
        schedule = self._get(n, B, T)
        self._weights, self._losses = list(weights), {}
        if self.is_first:
            schedule.step(inputs.to(self.device), return_outputs=False)
        elif self.is_last:
            pos = torch.arange(n, device=self.device).repeat_interleave(B)[:, None]  # (n*B, 1)
            schedule.step(target=torch.cat([pos, targets.to(self.device)], dim=1), losses=[], return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        return dict(self._losses)
