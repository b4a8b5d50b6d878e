"""Failure specs, schedules, the kinds' registry and the perturbation hook (with a recording kill: real kills
are end-to-end tests)."""

from __future__ import annotations

import os
import signal

import pytest

from recover.errors import ConfigError
from recover.faults import PHASES, FailureSchedule, FailureSpec, Perturbation, kind, parse_failure, random_schedule
from recover.faults.schedule import STEP_PHASES


# ---- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, spec", [
    ("1@5:backward", FailureSpec(1, 5, "backward")),
    ("0@0:idle", FailureSpec(0, 0, "idle")),
    ("3@12", FailureSpec(3, 12, "forward")),  # the phase defaults to forward
    (" 2 @ 7 : Reduce ", FailureSpec(2, 7, "reduce")),
])
def test_parse_good(text: str, spec: FailureSpec) -> None:
    assert parse_failure(text) == spec
    assert parse_failure(str(spec)) == spec  # str() is the command-line form


def test_parse_rank() -> None:
    assert parse_failure("1@5:commit", rank=2) == FailureSpec(1, 5, "commit", 2)
    with pytest.raises(ConfigError, match="rank"):
        parse_failure("1@5", rank=-1)


@pytest.mark.parametrize("text, match", [
    ("1-5", r"bad failure '1-5': write REPLICA@STEP\[:PHASE\], e.g. 1@5:backward"),
    ("", "write REPLICA@STEP"),
    ("1@5:backward:x", "write REPLICA@STEP"),
    ("a@5", r"bad failure 'a@5': REPLICA 'a' is not an integer; use an integer >= 0"),
    ("@5", "REPLICA '' is not an integer"),
    ("1@", "STEP '' is not an integer"),
    ("1@2.5", r"STEP '2.5' is not an integer"),
    ("-1@5", r"REPLICA '-1' is negative; use an integer >= 0 and write REPLICA@STEP"),
    ("1@-5:reduce", "STEP '-5' is negative"),
    ("1@5:backwrd", r"phase 'backwrd' is not a phase \(did you mean 'backward'\?\); use one of forward, "
                    "backward, reduce, commit, optimizer, idle, recover"),
    ("1@5:explode", r"phase 'explode' is not a phase; use one of forward"),
    ("1@5:", "phase '' is not a phase"),
])
def test_parse_bad(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_failure(text)
    assert isinstance(info.value, ConfigError) and "\n" not in str(info.value)


def test_spec_checks_its_fields() -> None:
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        FailureSpec(0, 1, "optimiser")
    with pytest.raises(ConfigError, match="step = -1"):
        FailureSpec(0, -1)
    assert FailureSpec.from_dict(FailureSpec(2, 3, "idle", 1).to_dict()) == FailureSpec(2, 3, "idle", 1)


# ---- validation -------------------------------------------------------------------------------
def test_validate_accepts_possible_schedules() -> None:
    s = FailureSchedule(["1@5:backward", "2@5:reduce", "3@1"])
    assert s.validate(replicas=4, steps=10) is s
    assert [str(x) for x in s] == ["3@1:forward", "1@5:backward", "2@5:reduce"]  # sorted by step, phase
    FailureSchedule(["1@2", "1@6", "2@6"]).validate(4, 10, min_replicas=2, rejoin=True)
    FailureSchedule([]).validate(1, 1)


@pytest.mark.parametrize("specs, kwargs, match", [
    (["4@1"], {}, r"failure 4@1:forward: replica 4 does not exist; replicas are 0\.\.3"),
    (["1@10:idle"], {}, r"failure 1@10:idle: step 10 is beyond the run; steps are 0\.\.9"),
    (["1@2", "1@6"], {}, r"failure 1@6:forward: replica 1 is already killed by 1@2:forward; let it rejoin"),
    (["1@2:forward", "1@2:reduce"], {"rejoin": True}, "killed by 1@2:forward; kill it at another step"),
    (["0@1", "1@2", "2@3", "3@4"], {}, r"leaving 0 of 4 \(min_replicas = 1\); kill at most 3"),
    (["0@1", "1@2"], {"min_replicas": 3}, r"kill at most 1, lower min_replicas"),
    (["0@1", "1@1", "2@1"], {"rejoin": True, "min_replicas": 2}, r"failures at step 1 kill replicas \[0, 1, 2\]"),
    ([FailureSpec(0, 1, rank=2)], {"ranks": 2}, r"rank 2 does not exist; a replica has ranks 0\.\.1"),
    ([], {"min_replicas": 5}, "min_replicas = 5 exceeds replicas = 4"),
])
def test_validate_refusals(specs: list, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FailureSchedule(specs).validate(replicas=4, steps=10, **kwargs)


def test_with_rejoins_every_replica_may_die_at_once_and_the_rejoined_restore_a_checkpoint() -> None:
    FailureSchedule(["0@1", "1@1", "2@1", "3@1"]).validate(replicas=4, steps=10, min_replicas=2, rejoin=True)
    with pytest.raises(ConfigError, match="kill at most 2"):  # without rejoins nobody would come back
        FailureSchedule(["0@1", "1@1", "2@1", "3@1"]).validate(replicas=4, steps=10, min_replicas=2)


def test_at_and_for_replica() -> None:
    s = FailureSchedule(["1@5:backward", "2@3", "1@8:idle"])
    assert s.at(1, 5, "backward") and s.at(2, 3, "forward")
    assert not s.at(1, 5, "forward") and not s.at(0, 5, "backward") and not s.at(1, 6, "backward")
    assert s.for_replica(1) == [FailureSpec(1, 5, "backward"), FailureSpec(1, 8, "idle")]
    assert s.for_replica(0) == []
    assert FailureSchedule.from_json(s.to_json()) == s


# ---- random schedules -------------------------------------------------------------------------
def test_random_schedule_is_deterministic_and_keeps_min_replicas() -> None:
    total = 0
    for seed in range(200):
        kw = dict(replicas=6, steps=50, mtbf_s=8.0, step_time_s=1.0, seed=seed, min_replicas=2)
        s = random_schedule(**kw)
        assert s == random_schedule(**kw)
        s.validate(6, 50, min_replicas=2)  # each replica at most once, at least 2 left
        assert len({x.replica for x in s}) <= 4 and all(0 <= x.step < 50 for x in s)
        total += len(s)
    assert total > 600  # ~6 expected failures per run, capped at 4: the cap binds
    assert random_schedule(6, 50, 8.0, 1.0, seed=1) != random_schedule(6, 50, 8.0, 1.0, seed=2)


def test_random_schedule_rate_and_phases() -> None:
    n = sum(len(random_schedule(100, 100, 20.0, 1.0, seed=s, phases=("reduce",))) for s in range(50))
    assert 200 <= n <= 300  # 100 s / 20 s = 5 per run on average
    assert {x.phase for s in range(20) for x in random_schedule(4, 100, 5.0, 1.0, seed=s)} == set(STEP_PHASES)
    assert {x.phase for x in random_schedule(100, 100, 5.0, 1.0, seed=0, phases=["commit"])} == {"commit"}
    assert len(random_schedule(4, 10, 1e6, 1.0, seed=0)) == 0


def test_random_schedule_with_rejoin() -> None:
    for seed in range(100):
        s = random_schedule(4, 60, 3.0, 1.0, seed=seed, min_replicas=2, rejoin_after_steps=5)
        s.validate(4, 60, min_replicas=2, rejoin=True)
        back: dict[int, int] = {}
        for x in s:  # never more than 2 down at once, under the rejoin assumption
            assert back.get(x.replica, -1) <= x.step
            back[x.replica] = x.step + 5
            assert sum(1 for b in back.values() if b > x.step) <= 2
    assert max(len(random_schedule(4, 60, 3.0, 1.0, seed=s, rejoin_after_steps=5)) for s in range(10)) > 4


def test_random_schedule_refusals() -> None:
    with pytest.raises(ConfigError, match="mtbf_s"):
        random_schedule(4, 10, 0.0, 1.0, seed=0)
    with pytest.raises(ConfigError, match="did you mean 'reduce'"):
        random_schedule(4, 10, 5.0, 1.0, seed=0, phases=["reduc"])
    with pytest.raises(ConfigError, match="too small"):
        random_schedule(4, 10**6, 1e-3, 1.0, seed=0, rejoin_after_steps=1)


# ---- the injector -----------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pid: int, sig: int) -> None:
        self.calls.append((pid, sig))


def drive(inj: Perturbation, steps: int = 10) -> list[tuple[int, str]]:
    fired = []
    for step in range(steps):
        for phase in PHASES:
            if inj.at_phase(step, phase):
                fired.append((step, phase))
    return fired


def test_injector_kills_exactly_at_the_matching_step_and_phase() -> None:
    specs = FailureSchedule(["1@5:backward", "2@3:reduce", "1@7:idle"]).specs
    rec = Recorder()
    inj = Perturbation(specs, replica=1, kill=rec)
    assert drive(inj) == [(5, "backward"), (7, "idle")]
    assert rec.calls == [(os.getpid(), signal.SIGKILL)] * 2
    assert inj.pending == [] and drive(inj) == []  # each spec fires once
    assert drive(Perturbation(specs, replica=0, kill=rec)) == []


def test_injector_rank_rule() -> None:
    specs = [FailureSpec(0, 2, "reduce"), FailureSpec(0, 4, "commit", rank=1)]
    fired = {rank: drive(Perturbation(specs, 0, rank=rank, ranks=3, kill=Recorder())) for rank in range(3)}
    assert fired == {0: [], 1: [(4, "commit")], 2: [(2, "reduce")]}  # rank None -> the last rank
    with pytest.raises(ValueError, match="rank = 3"):
        Perturbation(specs, 0, rank=3, ranks=3)


def test_the_event_is_recorded_before_the_kill_and_phases_are_checked() -> None:
    order: list[str] = []
    inj = Perturbation([FailureSpec(0, 1, "optimizer")], 0, kill=lambda pid, sig: order.append("kill"),
                       record=lambda spec, kind, fields: order.append(f"{kind} {spec} {fields['phase']}"))
    assert inj.at_phase(1, "optimizer") and order == ["kill 0@1:optimizer optimizer", "kill"]
    with pytest.raises(ValueError, match="did you mean 'backward'"):
        inj.at_phase(1, "backwards")


def test_phases_come_from_names() -> None:
    import recover.faults
    from recover.names import PHASES as NAMES_PHASES
    from recover.names import Phase

    assert recover.faults.PHASES is NAMES_PHASES and "recover" in NAMES_PHASES
    spec = parse_failure("1@5:Backward")
    assert spec.phase is Phase.BACKWARD and FailureSpec(1, 5, "backward") == spec
    assert spec.to_dict()["phase"] == "backward" and type(spec.to_dict()["phase"]) is str  # JSON keeps plain names


def test_hang_and_freeze_specs_round_trip_and_fire_their_fault() -> None:
    hang, freeze = parse_failure("1@5:backward=hang"), parse_failure("2@3", fault="freeze")
    assert (hang.fault, freeze.fault, str(hang), str(freeze)) == ("hang", "freeze", "1@5:backward=hang",
                                                                   "2@3:forward=freeze")
    assert parse_failure(str(hang)) == hang and FailureSpec.from_dict(hang.to_dict()) == hang
    assert str(parse_failure("0@1:reduce")) == "0@1:reduce"  # a kill keeps the plain form
    with pytest.raises(ConfigError, match="'nap' is not one of kill, hang, freeze"):
        parse_failure("1@2:forward=nap")
    signals, hangs = [], []
    for spec in (hang, freeze):
        inj = Perturbation([spec], spec.replica, kill=lambda pid, sig: signals.append(sig),
                            hang=lambda: hangs.append(True))
        assert inj.at_phase(spec.step, spec.phase)
    assert hangs == [True] and signals == [signal.SIGSTOP]  # the hang stops the thread, no signal


def test_slow_specs_parse_round_trip_and_never_count_as_failures() -> None:
    parse_slow = kind("slow").parse
    spec = parse_slow("2@10:4")
    assert (spec.replica, spec.step, spec.fault, spec.arg, spec.kills) == (2, 10, "slow", 4.0, False)
    assert parse_failure(str(spec)) == spec and FailureSpec.from_dict(spec.to_dict()) == spec
    FailureSchedule([spec, parse_slow("2@20:1"), "2@30"]).validate(3, 40)  # slowed twice, then killed once
    for bad in ("2@10", "2@10:0.5", "2@10:fast", "x@1:2"):
        with pytest.raises(ConfigError):
            parse_slow(bad)
    inj = Perturbation([spec, parse_slow("2@20:1")], replica=2, rank=0, ranks=2, kill=lambda *a: pytest.fail("killed"))
    assert not inj.at_phase(9, "forward") and inj.time_factor() == 1.0
    assert inj.at_phase(10, "forward") and inj.time_factor() == 4.0  # on every rank: rank 0 of 2 too
    assert inj.at_phase(20, "forward") and inj.time_factor() == 1.0 and inj.gradient(20, 0) is None


def test_cut_specs_name_another_existing_replica_and_never_count_as_failures() -> None:
    parse_cut = kind("cut").parse
    spec = parse_cut("1@5:2")
    assert (spec.replica, spec.step, spec.fault, int(spec.arg), spec.kills) == (1, 5, "cut", 2, False)
    assert parse_failure(str(spec)) == spec
    FailureSchedule([spec, "1@9"]).validate(3, 10)
    for bad in ("1@5:1", "1@5", "1@5:x"):
        with pytest.raises(ConfigError):
            parse_cut(bad)
    with pytest.raises(ConfigError, match="peer replica 7 does not exist"):
        FailureSchedule([parse_cut("1@5:7")]).validate(3, 10)
    inj = Perturbation([spec], replica=1, rank=1, ranks=2, kill=lambda *a: pytest.fail("killed"))
    assert not inj.unreachable(2) and inj.at_phase(5, "forward")
    assert inj.unreachable(2) and not inj.unreachable(0) and inj.heartbeats()


# ---- the registry and the hook ----------------------------------------------------------------------
def test_every_kind_is_registered_once_with_a_launch_flag_that_round_trips() -> None:
    from recover.cli import build_parser
    from recover.faults import random_kinds, registered
    from recover.launch.cli import fault_specs

    kinds = registered()
    assert list(kinds)[:8] == ["kill", "hang", "freeze", "slow", "cut", "corrupt", "nan", "miscompute"]
    assert random_kinds() == ("kill", "hang", "freeze")
    example = {"R@STEP:PHASE": "1@3:reduce", "R@STEP:FACTOR": "1@3:2", "R@STEP:PEER": "1@3:0", "R@STEP": "1@3",
               "R@STEP:ID": "1@3:4"}
    argv = [arg for k in kinds.values() for arg in (k.flag, example[k.metavar])]
    specs = fault_specs(build_parser().parse_args(["launch", "--out", "x", *argv]))
    assert [parse_failure(s).fault for s in specs] == list(kinds)  # each flag makes a spec of its own kind
    assert all(parse_failure(s) == kinds[parse_failure(s).fault].parse(example[kinds[parse_failure(s).fault].metavar])
               for s in specs)


def test_struck_by_reads_the_events_of_every_version() -> None:
    from recover.faults import struck_by

    assert struck_by({"kind": "kill", "fault": "hang"}).name == "hang"
    assert struck_by({"kind": "kill"}).name == "kill"  # older kills name no fault
    assert struck_by({"kind": "kill", "fault": "random"}).name == "kill"
    assert struck_by({"kind": "slowed", "factor": 3.0}).name == "slow"
    assert struck_by({"kind": "slowed", "factor": 1.0}) is None  # the end of a slow-down
    assert struck_by({"kind": "link_cut", "peer": 2}).name == "cut"
    assert struck_by({"kind": "injected", "fault": "nan", "microbatch": 3}).name == "nan"
    assert struck_by({"kind": "injected", "fault": "slow"}) is None  # a kind's strike is its own event
    assert struck_by({"kind": "recovered"}) is None


def test_gradient_faults_act_through_the_hook_only() -> None:
    import torch

    specs = [kind("nan").parse("0@2:5"), kind("miscompute").parse("0@3")]
    p = Perturbation(specs, 0)
    assert p.gradient(2, 5) is None  # nothing struck yet
    assert p.at_phase(2, "forward") and p.gradient(2, 4) is None and p.gradient(2, None) is None
    for _ in range(2):  # a recompute of the same microbatch (to find the non-finite one) meets it again
        grads = [torch.ones(3), torch.ones(2)]
        fn = p.gradient(2, 5)
        for g in grads:
            fn(g)
        assert grads[0].isnan().all() and torch.equal(grads[1], torch.ones(2))  # the first tensor of the pass
    assert p.at_phase(3, "forward")
    g = torch.ones(2, dtype=torch.float64)
    p.gradient(7, None)(g)
    assert torch.equal(g, torch.full((2,), 1 + 2**-8, dtype=torch.float64))


def test_corrupt_acts_on_the_target_on_its_rank_only() -> None:
    flipped: list[int] = []

    class Target:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def corrupt(self) -> None:
            flipped.append(self.rank)

    spec = kind("corrupt").parse("0@1")
    for rank in range(2):
        Perturbation([spec], 0, rank, 2, target=Target(rank)).at_phase(1, "forward")
    assert flipped == [1]  # the replica's last rank
