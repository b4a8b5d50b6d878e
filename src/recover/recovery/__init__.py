"""LAYER 2: in-step recovery (step protocol, ledger, gradient accumulator, commit)."""
