"""``recover launch``: a multi-replica job on one machine with real failures, and its reports."""
