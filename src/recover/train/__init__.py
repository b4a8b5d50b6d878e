"""The trainer: composes model, data, optimizer, checkpoints and (later) the protocol layers."""
