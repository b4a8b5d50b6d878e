"""Loss scaling for float16 training under recover (``Job(scaler=torch.amp.GradScaler(...))``), decided by the
committed step, so a run with failures stays bitwise the failure-free run's.

Contract: :class:`LossScale` takes a torch ``GradScaler``'s settings (its scale, growth and backoff factors,
growth interval) and from then on owns the scale; the scaler mirrors it (``get_scale()``), nothing more
(recover, not ``scaler.step``, runs the update). Each microbatch's loss is multiplied by :attr:`LossScale.scale`
before its backward (:meth:`recover.train.replicas.steps.Microbatch.backward`); an overflow there is no fault of the
replica (no microbatch is reported non-finite for its gradient). At the update (:meth:`OwnReplica.apply`) the
reduced gradient's norm decides for every replica alike: not finite, the update is skipped and the scale
multiplied by the backoff factor; finite, the sum is divided by M x scale (the clip applies to the unscaled
norm), and after ``growth_interval`` finite steps in a row the scale grows. The scale and that count travel
as extra state (to joiners, into checkpoints), so every replica, a joiner and a resumed run use the same.
"""

from __future__ import annotations

from typing import Any


class LossScale:
    """The dynamic loss scale of a torch ``GradScaler`` (see the module docstring). Raises ValueError for a
    disabled scaler (nothing to scale: leave it out)."""

    def __init__(self, scaler: Any) -> None:
        if not scaler.is_enabled():
            raise ValueError("the GradScaler given to Job is disabled: leave scaler out (no loss scaling)")
        state = scaler.state_dict()
        self.scaler = scaler
        self.scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.tracker = int(state.get("_growth_tracker", 0))

    def update(self, overflow: bool) -> None:
        """After a committed step: backoff on an overflow, else count towards growth."""
        if overflow:
            self.scale *= self.backoff_factor
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.tracker = 0
        self._mirror()

    def _mirror(self) -> None:
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": self.scale, "_growth_tracker": self.tracker})

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "tracker": self.tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.tracker = float(state["scale"]), int(state["tracker"])
        self._mirror()
