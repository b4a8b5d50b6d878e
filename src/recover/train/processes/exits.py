"""What a replica worker and its launcher agree on without importing torch: exit statuses, paths and
the placement variable.

The launcher (and ``recover launch``) only reads these; keeping them here keeps the launcher
process free of the multi-second torch import.
"""

from __future__ import annotations

from pathlib import Path

EXIT_QUORUM_LOST = 3
"""fewer than ``fault_tolerance.min_replicas`` replicas survived; a complete checkpoint was saved."""
EXIT_JOB_FAILED = 4
"""checkpoint-and-restart baseline: a replica failed and this survivor stopped for the relaunch."""
EXIT_FENCED = 5
"""the coordinator declared this replica dead (one of its ranks died, or it stopped heartbeating)."""
EXIT_STOPPED = 6
"""stopped on request (SIGTERM or SIGINT) at a step boundary after saving a complete checkpoint;
continue with ``--resume``."""
EXIT_COORDINATOR_LOST = 7
"""the coordinator did not come back within ``fault_tolerance.coordinator_reconnect_s``; a complete
checkpoint of the last committed step was saved; continue with ``--resume``."""
EXIT_DIVERGED = 8
"""the replicas' parameters disagree with no majority to trust (silent data corruption on as many
replicas as are healthy); each side's state was saved under ``checkpoints/diverged/``."""
EXIT_NONFINITE = 9
"""a microbatch's loss or gradient was not finite on two replicas (or some of every live replica's in one
step): the training itself diverged; the last committed state was saved."""

EXIT_BAD_DATA = 10
"""a microbatch held a token id beyond the model's vocabulary (named with its file and offset), or a shard
changed on disk under the run (named with its sizes): the data is wrong, on every replica alike; the
lowest member saved the last committed state."""

EXIT_STATE_LOST = 11
"""every replica that held the training state was lost and there was no intact checkpoint to fall back to
(with one, the job restores it and goes on by itself); run again, from the start or from a checkpoint of
another run."""

EXIT_UNSAVED = 12
"""the job ended (every step committed, stopped on request, too few replicas, the coordinator lost) but the
storage refused its final checkpoint (a full disk, an I/O error: one line names the path, the free space
and the cause): the committed steps stay recorded and the older checkpoints intact, so ``--resume``
continues from the newest of those, redoing the steps after it. ``recover launch`` ends with it too when
the storage refused its own ``summary.json`` after every step committed."""

EXIT_FILE_ENV = "RECOVER_EXIT_FILE"
"""A file the worker's local rank 0 writes its exit status to when it exits (when the variable is set):
under torchrun, which turns every rank's failure or signal into its own status 1, the cluster recipes read
a replica's real status there (the Slurm recipe's step wrapper)."""


def record_exit(code: int) -> None:
    """Writes ``code`` to ``$RECOVER_EXIT_FILE`` from local rank 0, if the variable is set; never raises."""
    import os

    path = os.environ.get(EXIT_FILE_ENV)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        Path(path).write_text(f"{code}\n")
    except OSError:
        pass  # the status is a courtesy to the wrapper; the exit itself must happen


EXIT_SCRIPT_ERROR = 13
"""a user's script raised the same exception (type and place) a second time, on the same replica or
another, at the same step or a later one: a bug in the script, not a hardware fault; the job stopped with
its line (the replica, the exception, its last lines, the log) after saving the last committed state; fix
the script and continue with ``--resume``. A broken contract of ``recover.api`` (``ContractError``) stops
the job the first time."""

EXIT_RAISED = 14
"""(a replica's own status, never the job's) the replica's script raised an exception for the first time in
this launch: the launcher shows it, and treats it as the loss of that replica (the others recover in-step;
``--rejoin-after`` brings it back)."""

PLACEMENT_ENV = "RECOVER_PLACEMENT"
"""Set for a process ``recover launch`` gave no GPU: ``none`` (it found none), ``shared`` (``--share-gpus``)."""


def replica_log_path(out: Path, replica: int) -> Path:
    """A replica's own step records (written by its rank 0; the launcher merges them)."""
    return Path(out) / "replicas" / f"replica_{replica}.jsonl"
