"""`recover demo`'s configuration, checked without running it: one run meets every kind of fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from recover.faults import parse_failure
from recover.launch.cli import check_launch
from recover.launch.demo import DEMO_FAULTS, STEPS, demo_failures, demo_requests


def test_the_demo_meets_a_crash_a_hang_a_straggler_and_a_corruption_in_order() -> None:
    specs = [parse_failure(text) for text in demo_failures(STEPS)]
    assert [s.fault for s in specs] == ["kill", "hang", "slow", "slow", "corrupt"]
    assert [s.step for s in specs] == sorted(s.step for s in specs) and specs[-1].step < STEPS - 5
    assert specs[3].replica == specs[2].replica and specs[3].arg == 1  # the straggler recovers
    lost = [s.replica for s in specs if s.kills]
    assert len(set(lost)) == len(lost) == 3  # three distinct replicas lost: a strict majority always healthy
    assert len(DEMO_FAULTS) == len(specs)


def test_check_launch_accepts_both_demo_runs_deterministic_with_rejoins(tmp_path: Path) -> None:
    reference, faults = demo_requests(tmp_path, progress=False)
    assert reference.out.parent == faults.out.parent == tmp_path and faults.reference == reference.out
    for request in (reference, faults):
        opts = check_launch(request)
        assert opts.config.training.deterministic and opts.config.parallel.replicas == 4
        assert opts.config.fault_tolerance.hang_timeout_s > 0  # a hang is found in seconds, not 60
    assert not reference.failures and faults.rejoin_after_s is not None
    assert len(check_launch(faults).failures.specs) == len(DEMO_FAULTS)


def test_the_printed_launch_flags_inject_the_same_faults() -> None:
    """What the demo prints (to reproduce it with `recover launch`) is what it runs."""
    from recover.cli import build_parser
    from recover.launch.cli import fault_specs

    flags = " ".join(fault.flag(STEPS) for fault in DEMO_FAULTS).split()
    args = build_parser().parse_args(["launch", "--out", "x", *flags])
    assert sorted(fault_specs(args)) == sorted(demo_failures(STEPS))


def test_the_closing_lines_name_commands_that_parse(tmp_path: Path) -> None:
    """What the demo tells a new user to try next is a valid command line of this recover."""
    import shlex

    from recover.cli import build_parser
    from recover.launch.demo import next_commands

    lines = [line.split("#")[0].strip() for line in next_commands(tmp_path / "failures").splitlines()[1:]]
    parsed = [build_parser().parse_args(shlex.split(line)[1:]) for line in lines]
    assert [a.command for a in parsed] == ["sample", "export", "report", "status"]


def test_the_readmes_demo_tables_are_a_block_the_demo_writes() -> None:
    """The README's tables used to be pasted (and went stale: val loss 2.6033 shown, 2.6797 measured); `recover demo
    --readme README.md` writes them into the block after the marker."""
    from recover.launch.demo import README_MARKER, with_tables

    readme = (ROOT / "README.md").read_text()
    assert readme.count(README_MARKER) == 1
    replaced = with_tables(readme, "T1\nT2\n")
    assert f"{README_MARKER}\n```\nT1\nT2\n```\n" in replaced
    assert replaced.split(README_MARKER)[0] == readme.split(README_MARKER)[0]
    assert replaced.split("T2\n```\n")[1] == readme.split(README_MARKER + "\n```\n")[1].split("\n```\n", 1)[1]
    with pytest.raises(ValueError, match="no .* block"):
        with_tables("no marker here", "T")
