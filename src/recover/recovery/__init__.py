"""LAYER 2: in-step recovery: the step protocol (:mod:`recover.recovery.protocol`) and the typed
interfaces of its collaborators (:mod:`recover.recovery.interfaces`)."""
