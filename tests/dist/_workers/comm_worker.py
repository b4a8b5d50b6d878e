"""A replica process for the layer-1 tests, driven by JSON lines on stdin; replies on stdout.

Start: ``comm_worker.py --port P --token T --replica R [--join]``. It registers, forms its group
(a joiner then receives state), prints ``{"event": "ready", ...}`` and serves commands:

  {"op": "allreduce", "n": N, "seed": S, "repeat": K, "hold": false, "announce": false}
      K all-reduces of this replica's deterministic tensors (integers in float32/float64/int64, so
      sums are exact); each is checked against the expected sum over the group's members and the
      inputs are checked bit for bit. After the first success it prints {"event": "looping"}; with
      "announce" it prints {"event": "launched"} as it enters each all-reduce. On
      PeerFailure it prints {"event": "failure", ...} (with "hold" also {"event": "holding"}, then
      waits for a "go" line), calls next_generation() and repeats the all-reduce on the new group.
  {"op": "vote", "step": S, "ids": [...]}   commit vote; a new membership (joiners) is followed by
      next_generation() and a state transfer to the joiners.
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

import torch

from recover.comm import FaultTolerantGroup, receive_state, send_state, source_rank
from recover.coord import CoordinatorClient
from recover.errors import PeerFailure, RecoverError


def emit(**rec: object) -> None:
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def make_tensors(replica: int, seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1009 + replica)
    return [
        torch.randint(-1000, 1000, (n,), generator=g).to(torch.float32),
        torch.randint(-1000, 1000, (3, 5), generator=g).to(torch.float64),
        torch.randint(-1000, 1000, (7,), generator=g),
    ]


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(257, 33, generator=g),
        "b16": torch.randn(19, generator=g).to(torch.bfloat16),
        "step": torch.tensor(41, dtype=torch.int64),
        "mask": torch.rand(11, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
    }


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for x, y in zip(a, b, strict=True))


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.replica = args.replica
        self.client = CoordinatorClient("127.0.0.1", args.port, args.token, args.replica,
                                        heartbeat_interval_s=args.hb_interval)
        m = self.client.register(join=args.join, timeout=120)
        self.group = FaultTolerantGroup.create(self.client, m, backend="gloo", timeout_s=args.timeout)
        self.state = None if args.join else model_state()
        if args.join:
            self.state = dict(receive_state(self.group, source_rank(self.group)))
        emit(event="ready", replica=self.replica, pid=os.getpid(), generation=self.group.generation,
             members=list(self.group.members), state=state_digest(self.state),
             state_ok=bitwise_equal(list(self.state.values()), list(model_state().values())))

    def expected(self, n: int, seed: int) -> list[torch.Tensor]:
        per_member = [make_tensors(r, seed, n) for r in self.group.members]
        return [sum(ts) for ts in zip(*per_member, strict=True)]

    def one_allreduce(self, xs: list[torch.Tensor], before: list[torch.Tensor],
                      expected: list[torch.Tensor], announce: bool = False) -> dict[str, object]:
        t0 = time.monotonic()
        if announce:
            emit(event="launched", replica=self.replica, generation=self.group.generation)
        try:
            out = self.group.allreduce(xs)
        except PeerFailure as exc:
            return {"failure": {"generation": exc.generation, "dead": list(exc.dead), "reason": exc.reason,
                                "t_start": t0, "t_raise": time.monotonic(),
                                "t_notice": self.client.notice_time(exc.generation),
                                "intact": bitwise_equal(xs, before)}}
        correct = bitwise_equal(out, expected)
        self.group.release(out)  # the next all-reduce reuses these buffers
        return {"correct": correct, "intact": bitwise_equal(xs, before),
                "generation": self.group.generation, "members": list(self.group.members)}

    def allreduce(self, n: int, seed: int, repeat: int, hold: bool, announce: bool) -> dict[str, object]:
        xs = make_tensors(self.replica, seed, n)
        before = [x.clone() for x in xs]
        expected = self.expected(n, seed)
        results = []
        for i in range(repeat):
            r = self.one_allreduce(xs, before, expected, announce)
            if "failure" not in r:
                results.append(r)
                if i == 0:
                    emit(event="looping", replica=self.replica)
                continue
            failure = r["failure"]
            emit(event="failure", replica=self.replica, **failure)
            if hold:
                emit(event="holding", replica=self.replica)
                sys.stdin.readline()
            self.group = self.group.next_generation()
            failure["t_ready"] = time.monotonic()
            failure["new_generation"] = self.group.generation
            failure["new_members"] = list(self.group.members)
            after = self.one_allreduce(xs, before, self.expected(n, seed))
            return {"ok": all(x["correct"] and x["intact"] for x in results), "iters": len(results),
                    "failure": failure, "after": after}
        return {"ok": all(x["correct"] and x["intact"] for x in results), "iters": len(results),
                "failure": None, "generation": self.group.generation, "members": list(self.group.members)}

    def vote(self, step: int, ids: list[int]) -> dict[str, object]:
        try:
            new = self.client.vote_commit(self.group.generation, step, ids)
        except PeerFailure as exc:
            return {"result": "peer_failure", "dead": list(exc.dead)}
        if new is None:
            return {"result": "committed"}
        self.group = self.group.next_generation()
        src = source_rank(self.group)
        assert self.state is not None
        if self.group.rank == src:
            digest = send_state(self.group, self.state)
            got = self.state
        else:
            got = receive_state(self.group, src)
            digest = None
        return {"result": "joined", "generation": self.group.generation, "members": list(self.group.members),
                "joined": list(self.group.membership.joined), "state": state_digest(got), "payload": digest,
                "state_ok": bitwise_equal(list(got.values()), list(self.state.values()))}

    def serve(self) -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            try:
                if op == "exit":
                    break
                if op == "allreduce":
                    res = self.allreduce(cmd["n"], cmd["seed"], cmd.get("repeat", 1), cmd.get("hold", False),
                                         cmd.get("announce", False))
                elif op == "vote":
                    res = self.vote(cmd["step"], cmd["ids"])
                else:
                    res = {"error": f"unknown op {op!r}"}
            except (RecoverError, RuntimeError, TimeoutError) as exc:
                res = {"error": f"{type(exc).__name__}: {exc}"}
            emit(reply=op, replica=self.replica, **res)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump for a hung test
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--join", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--hb-interval", type=float, default=0.1)
    args = p.parse_args()
    try:
        Worker(args).serve()
    except (RecoverError, RuntimeError, TimeoutError) as exc:
        emit(event="fatal", replica=args.replica, error=f"{type(exc).__name__}: {exc}")
    sys.stdout.flush()
    os._exit(0)  # parked groups may hold stuck gloo work; do not wait for their timeouts


if __name__ == "__main__":
    main()
