"""Operator tools: ``recover check`` (is this host fit to train?) and the ``make gpu-check`` runbook.

Contract: no layer imports this package; it sits at the bottom of the stack and imports downward
(:mod:`recover.comm` to build process groups as recover does, :mod:`recover.model` and
:mod:`recover.train` for the determinism check, :mod:`recover.bench` for the peak tables and the
process helpers). Importing it imports no torch: measurements import torch inside functions, most of
them in child processes.
"""
