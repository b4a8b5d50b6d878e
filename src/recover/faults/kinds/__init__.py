"""One module per fault kind, each registering its :class:`~recover.faults.registry.FaultKind`.

A new kind is a new module here (and its test): :func:`recover.faults.registry.registered` finds every
module of this package, and the flags, the schedule's checks, the injection, the reports and goodput
read the kinds from there.
"""
