"""Model code no one here wrote, from a training framework: torchtitan's own Llama 3 (its registry's debug flavour,
random weights, built on the meta device and initialised by its ``init_states``, SDPA attention), trained by a
user loop on `recover.api` as the replicas of `recover launch -- python SCRIPT`, through a corrupted replica, a
crash and a hang: every step M microbatches, bitwise equal to the failure-free run of the same script. A joiner's
copy of the model, rebuilt and given the transferred state, computes bitwise what the live one does (its RoPE
caches are its own: non-persistent buffers are not sent; torchtitan's state-dict hooks' copies are not sent).

Four replicas, not three: each fault takes one out, and a corruption is found only by a strict majority of the
parameter fingerprints, so three faults on three replicas would need a rejoin in between, and a joiner's start-up
(Python, torch, torchtitan: ~10 s on 2 cores) outlasts this run. The reference is one replica: in deterministic
mode a step's sum does not depend on how many replicas computed it, and each one more costs a start-up.
Marked `interop` (torchtitan installed --no-deps by `make test-interop`; it needs Python >= 3.11)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import NO_PLOTS, ROOT, losses, run_recover

pytest.importorskip("torchtitan", reason="torchtitan is not installed (make test-interop installs it)")
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_titan.py"
STEPS, M = 5, 4  # the script's


def launch(out: Path, replicas: int, *faults: str) -> list[dict]:
    run_recover(["launch", NO_PLOTS,
                 "--config", "debug", "--replicas", str(replicas), "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--deterministic", "--fault_tolerance.hang_timeout_s=3",
                 "--workload.policy=even",  # every replica computes in every step, so each fault lands in its step
                 *faults, "--", sys.executable, str(SCRIPT)], timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    return rows


@pytest.mark.interop
def test_torchtitans_llama3_trains_bitwise_through_a_corruption_a_kill_and_a_hang(tmp_path: Path) -> None:
    launch(tmp_path / "ref", 1)
    rows = launch(tmp_path / "run", 4, "--corrupt", "0@1", "--fail", "1@2:backward", "--hang", "2@3:forward")
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")  # bitwise
    assert [r["live_replicas"] for r in rows] == [4, 3, 2, 1, 1]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert sorted(e["fault"] for e in events if e["kind"] == "kill") == ["hang", "kill"]
    assert {e["replica"] for e in events if e["kind"] == "fenced"} == {0, 2}  # the corrupted one, the hung one


@pytest.mark.interop
def test_a_joiners_rebuilt_llama3_with_the_transferred_state_computes_bitwise_what_the_live_one_does() -> None:
    from recover.train.replicas.own import OwnReplica

    spec = importlib.util.spec_from_file_location("train_titan", SCRIPT)
    titan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(titan)  # the model's config and construction; main() does not run
    cpu = torch.device("cpu")

    def replica() -> tuple[torch.nn.Module, OwnReplica]:
        model = titan.build(cpu)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, OwnReplica(model, optimizer, lr=None, clip=0.0, deterministic=True, device=cpu)

    def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
        loss = titan.loss_of(model, *titan.sample(step, 0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    live, sender = replica()
    train_step(live, sender.optimizer, 0)
    state = sender.transfer_state({"step": 1})
    assert {k for k in state if k.startswith("model.")} == {f"model.{n}" for n, _ in live.named_parameters()}
    joiner, receiver = replica()  # built as at the job's start: its parameters are the untrained ones
    receiver.load_transfer_state(state)
    assert torch.equal(train_step(joiner, receiver.optimizer, 1), train_step(live, sender.optimizer, 1))
    for (name, a), b in zip(live.named_parameters(), joiner.parameters(), strict=True):
        assert torch.equal(a, b), name
