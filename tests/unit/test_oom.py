"""Telling an OOM kill (:mod:`recover.launch.oom`): where the memory controllers are, and their counts."""

from __future__ import annotations

from pathlib import Path

from recover.launch.oom import OomKill, _count, _mounts

MOUNTINFO = """\
25 30 0:23 / /sys/fs/cgroup rw,nosuid shared:9 - tmpfs tmpfs ro,mode=755
33 25 0:28 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
36 25 0:31 / /sys/fs/cgroup/memory rw,nosuid shared:14 - cgroup cgroup rw,memory
37 25 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct
"""


def test_the_v1_memory_controller_and_the_unified_hierarchy_are_found_in_mountinfo() -> None:
    assert _mounts(MOUNTINFO) == {"v2": Path("/sys/fs/cgroup/unified"), "v1": Path("/sys/fs/cgroup/memory")}
    assert _mounts("") == {}


def test_oom_kill_counts_are_read_from_v2_events_and_v1_oom_control(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v2.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert (_count(v2), _count(v1)) == (2, 5)
    (tmp_path / "old").write_text("oom_kill_disable 0\nunder_oom 0\n")  # a kernel before the count
    assert _count(tmp_path / "old") is None and _count(tmp_path / "missing") is None
    assert OomKill("/job", 3 << 30).describe() == (
        "out of memory (the kernel's OOM killer, memory cgroup /job, peak 3072 MiB)")
