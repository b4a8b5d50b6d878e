"""The one rule that merges the replicas' step records (launcher and `recover collect` alike)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from recover.launch.records import JsonlTail, LogEpochs, StepRecords, metrics_row, read_step_logs, stamp, write_metrics


def rec(step: int, t: float, replica: int, loss: float = 5.0, **extra: object) -> dict[str, object]:
    return {"t": t, "step": step, "loss": loss, "microbatches": 8, "time_s": 0.5, "replica": replica, **extra}


def test_duplicates_from_several_replicas_merge_into_the_highest_replicas_with_the_val_loss_of_any() -> None:
    merged = StepRecords([
        rec(0, 10.0, 0), rec(0, 10.1, 1), rec(0, 10.1, 2),  # one commit: the higher replica
        rec(1, 11.2, 0, val_loss=4.5, eval_s=0.2), rec(1, 11.1, 1),  # only replica 0 evaluated
    ]).merged()
    assert sorted(merged) == [0, 1]
    assert merged[0]["replica"] == 2
    assert merged[1]["replica"] == 1 and merged[1]["val_loss"] == 4.5 and merged[1]["eval_s"] == 0.2


def test_a_redone_step_is_its_latest_commit_whatever_the_order_records_arrive_in() -> None:
    records = [rec(2, 12.0, 0, loss=3.9, generation=1), rec(2, 12.1, 1, loss=3.9, val_loss=4.0, generation=1),
               rec(3, 13.0, 0, loss=3.7, generation=1),  # then a restore of the checkpoint of step 2 redid 2 and 3
               rec(2, 9.0, 1, loss=3.8, generation=3), rec(3, 10.0, 1, loss=3.6, val_loss=3.5, generation=3)]
    for order in itertools.permutations(records):
        merged = StepRecords(order).merged()
        assert (merged[2]["loss"], merged[3]["loss"]) == (3.8, 3.6)
        assert (merged[2]["val_loss"], merged[3]["val_loss"]) == (4.0, 3.5)  # step 2's redo did not evaluate


def test_a_replica_whose_clock_jumps_an_hour_ahead_wins_nothing() -> None:
    merged = StepRecords([rec(5, 3600.0 + 15.0, 0, loss=3.0, generation=2, live_replicas=3),
                          rec(5, 15.1, 1, loss=3.0, generation=2, live_replicas=3),
                          rec(5, 14.0, 2, loss=3.1, generation=1)]).merged()  # the commit before a failure round
    assert merged[5]["replica"] == 1


def test_a_new_coordinators_generations_start_a_new_epoch_of_each_log(tmp_path: Path) -> None:
    log = tmp_path / "replica_0.jsonl"
    lines = [rec(0, 1.0, 0, generation=4), rec(1, 2.0, 0, generation=4, loss=4.0),
             rec(1, 3.0, 0, generation=1, loss=3.0)]  # the job restarted from step 1's checkpoint
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    marked = read_step_logs([log])
    assert [r["epoch"] for r in marked] == [0, 0, 1]
    assert StepRecords(marked).record(1)["loss"] == 3.0
    epochs = LogEpochs()  # the launcher's: the same, read piece by piece
    assert [r["epoch"] for p in ([lines[0]], lines[1:]) for r in epochs.mark(log, p)] == [0, 0, 1]


def test_gaps_and_what_is_not_a_step_record() -> None:
    records = StepRecords()
    assert [records.add(r) for r in (rec(0, 1.0, 0), rec(2, 3.0, 0), {"t": 2.0, "kind": "kill", "replica": 1},
                                     {"t": 2.0, "step": "1", "loss": 1.0}, {"step": 1, "loss": 1.0}, [1], 7)] == \
        [True, True, False, False, False, False, False]
    assert records.steps() == [0, 2] and records.committed() == 1 and records.last_step() == 2
    records.add(rec(1, 2.0, 0))
    assert records.committed() == 3 and len(records) == 3
    assert records.forget_from(1) == [1, 2] and records.steps() == [0] and 1 not in records
    assert StepRecords().committed() == 0 and StepRecords().last_step() == -1


def test_a_torn_last_line_waits_for_its_end_and_a_line_torn_for_good_is_skipped(tmp_path: Path) -> None:
    path, tail = tmp_path / "replica_0.jsonl", JsonlTail()
    assert tail.read(path) == []  # not written yet
    first, second = json.dumps(rec(0, 1.0, 0)), json.dumps(rec(1, 2.0, 0))
    path.write_text(first + "\n" + second[:9])  # the writer is between two writes
    assert tail.read(path) == [rec(0, 1.0, 0)]
    with open(path, "a") as f:
        f.write(second[9:] + "\n" + second[:5])
    assert tail.read(path) == [rec(1, 2.0, 0)] and tail.read(path) == []
    with open(path, "a") as f:  # that writer was killed; a rejoined replica appends after its fragment
        f.write(json.dumps(rec(2, 3.0, 0)) + "\n" + json.dumps(rec(3, 4.0, 0)) + "\n[3]\n")
    assert tail.read(path) == [rec(3, 4.0, 0)]


def test_metrics_rows_are_in_step_order_with_the_elapsed_time(tmp_path: Path) -> None:
    records = StepRecords([rec(1, 12.5, 0), rec(0, 11.0, 1), rec(0, 11.25, 0)])
    write_metrics(tmp_path / "metrics.jsonl", records, t0=10.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["replica"], r["elapsed_s"]) for r in rows] == [(0, 1, 1.0), (1, 0, 2.5)]
    assert all("t" not in r for r in rows)


def test_resume_completes_the_rows_a_torn_metrics_file_lost_from_the_replicas_records_and_names_the_rest() -> None:
    from recover.launch.records import recover_rows

    t0 = 1000.0
    replica = [{"step": s, "loss": 5.0 - s, "t": t0 + 10 + s, "time_s": 1.0, "replica": r, "microbatches": 8}
               for s in range(5) for r in (0, 1) if s != 3]
    kept = {s: {"step": s, "loss": 5.0 - s, "elapsed_s": 10.0 + s, "microbatches": 8} for s in (0, 1)}  # 2.. torn
    rows, lost = recover_rows(kept, replica, before=5)
    assert sorted(rows) == [0, 1, 2, 4] and lost == [3]  # step 3: nobody holds it
    assert rows[2]["loss"] == 3.0 and rows[2]["elapsed_s"] == 12.0 and rows[4]["replica"] == 1  # exact time
    records = StepRecords(rows[s] | {"t": rows[s]["elapsed_s"]} for s in rows)
    records.mark_lost(lost)
    assert records.committed() == 5 and 3 in records and records.steps() == [0, 1, 2, 4]


def test_a_record_is_timed_by_when_it_was_written_on_this_hosts_clock_else_when_it_was_read() -> None:
    since, now = 100.0, 250.0  # the launcher started at 100 on its monotonic clock; it reads at 250
    assert stamp(rec(0, 1e9, 0, mono=249.987), since, now) == 249.987  # written 13 ms ago, here
    assert stamp(rec(0, 1e9, 0), since, now) == now  # no clock of its own (an older release's record)
    assert stamp(rec(0, 1e9, 0, mono=50.0), since, now) == now  # before this launcher: an older run's
    assert stamp(rec(0, 1e9, 0, mono=9e5), since, now) == now  # another host's clock, ahead of ours
    assert "mono" not in metrics_row(rec(3, 12.5, 1, mono=249.0), t0=10.0)  # not a column of metrics.jsonl
