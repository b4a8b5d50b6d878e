"""The metrics of a real job read back by TensorBoard's and W&B's own readers (observe.*).

One short `recover launch` (the debug preset, 2 replicas, 16 steps, replica 1 killed at step 5 and
replaced) with ``observe.tensorboard = true`` and ``observe.wandb = "offline"`` (``WANDB_DIR`` in the
test's directory). TensorBoard's ``EventAccumulator`` must read each replica's losses as in
``metrics.jsonl`` and the job's generations, members and faults; each W&B offline run (one per replica
process, grouped by the run directory) must hold the same losses, decoded by W&B's own record protobuf
(the killed process's run may hold nothing: W&B writes it from a buffer that a SIGKILL loses; its
TensorBoard file keeps steps 0-4).
Marked `interop`: `make test-interop` installs tensorboard and wandb.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from conftest import NO_PLOTS, run_recover

pytestmark = pytest.mark.interop
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="tensorboard is not installed (make test-interop installs it)")
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb is not installed "
                               "(make test-interop installs it)")

STEPS = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("metrics") / "job"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(out.parent / "wandb-dir"))  # the launch's processes inherit it
        run_recover(["launch", NO_PLOTS,
                     "--config", "debug", "--replicas", "2", "--steps", str(STEPS), "--out", str(out),
                     "--no-progress", "--data.path", str(corpus), "--deterministic", "--fail", "1@5:backward",
                     "--rejoin-after", "0", "--device-time-s", "0.1", "--observe.tensorboard", "true",
                     "--observe.wandb", "offline"],
                    timeout=300)
    return out


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def accumulator(path: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.SCALARS: 0,
                                                                       event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def test_tensorboard_reads_every_replica_and_the_job(run: Path) -> None:
    want = losses(run)
    assert sorted(want) == list(range(STEPS))
    assert sorted(p.name for p in (run / "tensorboard").iterdir()) == ["job", "replica_0", "replica_1"]
    r0 = accumulator(run / "tensorboard" / "replica_0")
    assert {"train/loss", "perf/tokens_per_s", "perf/step_s", "train/lr"} <= set(r0.Tags()["scalars"])
    got = {e.step: e.value for e in r0.Scalars("train/loss")}
    assert sorted(got) == list(range(STEPS))
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want)  # stored as float32
    r1 = {e.step: e.value for e in accumulator(run / "tensorboard" / "replica_1").Scalars("train/loss")}
    assert len(list((run / "tensorboard" / "replica_1").glob("events.out.tfevents.*"))) == 2  # killed, replaced
    assert 0 in r1 and STEPS - 1 in r1 and all(r1[s] == pytest.approx(want[s], rel=1e-6) for s in r1)
    job = accumulator(run / "tensorboard" / "job")
    generations = [e.value for e in job.Scalars("job/generation")]
    members = [e.value for e in job.Scalars("job/members")]
    assert generations == sorted(generations) and generations[-1] >= 3
    assert members[:2] == [2, 1] and 2 in members[2:]  # both, the survivor, both again (then the end's goodbyes)
    assert len(job.Scalars("job/step_s")) == STEPS - 1
    faults = [t.tensor_proto.string_val[0].decode() for t in job.Tensors("faults")]
    assert any(f.startswith("failure: replica 1") for f in faults) and "joined: replica [1]" in " ".join(faults)


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
    framing (32 KiB blocks; per chunk CRC-32 of type and data, length, type FULL 1, FIRST 2, MIDDLE 3,
    LAST 4) around W&B's own ``Record`` protobuf, which decodes each."""
    data, i, part, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a header is padding
            i += 32768 - i % 32768
            continue
        crc, n, kind = struct.unpack_from("<IHB", data, i)
        chunk = data[i + 7:i + 7 + n]
        i += 7 + n
        if kind == 0:
            continue
        assert crc == zlib.crc32(bytes([kind]) + chunk)
        part += chunk
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_wandb_offline_runs_hold_the_same_losses(run: Path) -> None:
    want = losses(run)
    files = sorted((run.parent / "wandb-dir" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 3  # replica 0, replica 1 until its kill, its replacement
    seen: dict[str, dict[int, float]] = {}
    for path in files:
        records = wandb_records(path)
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if not runs:  # the SIGKILLed process: W&B had written nothing of it but the file's header
            assert path.stat().st_size == 7
            continue
        (info,) = runs
        assert (info.run_group, info.job_type, info.project) == (run.name, "replica", "recover")
        history = {int(r.history.step.num): {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                                 for item in r.history.item}
                   for r in records if r.WhichOneof("record_type") == "history"}
        assert history and all(h["train/loss"] == pytest.approx(want[s], rel=1e-12) for s, h in history.items())
        seen.setdefault(info.display_name, {}).update({s: h["train/loss"] for s, h in history.items()})
    assert sorted(seen) == ["replica_0", "replica_1"]
    assert sorted(seen["replica_0"]) == list(range(STEPS)) and STEPS - 1 in seen["replica_1"]  # its replacement
