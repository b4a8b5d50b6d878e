"""``recover bench data``: the data path at pre-training scale: start-up, memory and cost per sample as the
dataset grows to W = 1e10 windows, the data wait per step with and without prefetch, and ``recover
prepare``'s throughput on every core against one.

Contract:
- Datasets (:func:`make_dataset`): llm.c GPT-2 shards (uint16, the 1 KB header) of ``--sizes`` tokens
  (default 1e7, 1e9, 1e10) in shards of :data:`SHARD_TOKENS` tokens, plus one of W = 1e10 windows of
  ``seq_len`` 1024 (1.02e13 tokens in shards of 2**30). The token bodies are sparse files (holes read as
  token 0), so 20 TB of shards fit this disk; ``meta.json`` records what ``recover prepare`` would: the
  vocabulary (GPT-2's) and the largest id (0). They live under ``OUT/data`` and are reused.
- Start-up (:func:`startup`), ``rounds`` times per dataset, in alternating order: every shard is evicted
  from the page cache first (``posix_fadvise(DONTNEED)``: a cold start, as on a fresh node), then a fresh
  process (:func:`probe`) imports recover, opens the samplers as a replica does (:func:`open_samplers`:
  the launch checks, then the training and validation windows) and draws ``samples`` microbatches. Measured:
  the wall time from spawning the process to its first microbatch (``startup_s``, what a run waits for),
  the open alone (``open_s``), the resident memory the sampler adds (``sampler_mb``: RSS after the draws
  minus RSS after the imports) and the cost per sample (``sample_us``). ``vs_smallest`` is a dataset's
  median start-up over the smallest's (acceptance: <= 2 for 1e10 tokens against 1e7).
- Data wait (:func:`data_wait`): a replica's loop on the largest token dataset (cold), ``WAIT_STEPS``
  steps of its share of ``WAIT_SHARE`` microbatches, each computed for ``--device-ms`` (an emulated GPU:
  a sleep), the reads through :class:`~recover.data.prefetch.Prefetcher` as a replica does (this step's
  share and the next ``prefetch`` steps' ahead), with ``data.prefetch`` 0 (reads on the training thread)
  and 2, on local storage and with ``--latency-ms`` added to every read (shared storage). Measured: the
  training thread's wait per step (median over steps, then over rounds) as a share of the step time
  (acceptance: < 1% with prefetch).
- Before (:func:`materialised`): the order recover used to hold, ``numpy.random.default_rng(..).permutation(W)``,
  timed and its memory measured in a fresh process at W = 1e6, 1e7, 1e8, beside the keyed shuffle of
  :mod:`recover.data.shuffle` at the same W.
- Prepare (:func:`prepare_throughput`): ``recover prepare`` on ``--prepare-mb`` MB of text (the Python
  standard library's sources, copied until the size is reached) with one worker against every core the
  process may use, ``rounds`` times in alternating order, each into a fresh directory: MB/s and tokens/s
  (medians), per core, and the ratio (acceptance: >= 1.7x on 2 cores). The tokenizer is a byte-level BPE
  (``--tokenizer FILE``, else one of 16,384 ids trained here on the same sources with the ``tokenizers``
  package, the ``hf`` extra); the byte tokenizer, too cheap to gain from more processes, is run once
  each way for reference.
- Every table states the machine (cores, load before and after); ``OUT/results.json`` and ``--json FILE``
  hold everything; ``OUT/data.png`` plots start-up and sampler memory against W.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recover.bench.common import (
    Log,
    child_env,
    fmt,
    machine_load,
    median,
    print_rich_table,
    round_orders,
    stderr_log,
    write_json,
)
from recover.errors import ConfigError

SHARD_TOKENS = 100_000_000  # as llm.c's FineWeb shards
HUGE_SHARD_TOKENS = 1 << 30  # the W = 1e10 dataset: 9,537 shards instead of 102,400
SIZES = (10_000_000, 1_000_000_000, 10_000_000_000)
HUGE_WINDOWS = 10_000_000_000
SEQ_LEN = 1024
MICROBATCH = 8
MICROBATCHES = 8
SAMPLES = 64  # microbatches drawn by each probe
ROUNDS = 3
PERM_SIZES = (1_000_000, 10_000_000, 100_000_000)
WAIT_STEPS = 12
WAIT_SHARE = 4  # microbatches of a replica's share per step (M = 8 over 2 replicas)
DEVICE_MS = 50.0  # an 8 x 1024-token microbatch of a ~125M model on a GPU
LATENCY_MS = 5.0  # a read from shared storage
PREPARE_MB = 30.0
VAL_TOKENS = 1_000_000
GPT2_VOCAB = 50257


# ---------------------------------------------------------------- synthetic datasets


def _sparse_shard(path: Path, tokens: int) -> None:
    """An llm.c GPT-2 shard of ``tokens`` tokens whose body is a hole (reads as zeros)."""
    import numpy as np

    from recover.data.shards import GPT2_MAGIC, GPT2_VERSION, HEADER_INTS

    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (GPT2_MAGIC, GPT2_VERSION, tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.truncate(header.nbytes + 2 * tokens)


def make_dataset(root: Path, tokens: int, shard_tokens: int) -> Path:
    """``root`` holding ``tokens`` training tokens in ``train_NNNNNN.bin`` shards, a validation shard and a
    ``meta.json`` (vocabulary and largest id); reused when its meta.json says it is complete."""
    meta_path = root / "meta.json"
    want = {"tokens": tokens, "shard_tokens": shard_tokens}
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("bench") == want:
        return root
    root.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)
    for old in root.glob("*.bin"):
        old.unlink()
    left, names = tokens, []
    while left > 0:
        n = min(shard_tokens, left)
        names.append(f"train_{len(names):06d}.bin")
        _sparse_shard(root / names[-1], n)
        left -= n
    _sparse_shard(root / "val_000000.bin", VAL_TOKENS)
    meta = {"vocab_size": GPT2_VOCAB, "max_id": 0, "format": "llmc", "tokenizer": "synthetic (sparse zeros)",
            "train": {"tokens": tokens, "shards": names}, "val": {"tokens": VAL_TOKENS, "shards": ["val_000000.bin"]},
            "bench": want}
    meta_path.write_text(json.dumps(meta))
    return root


def evict(root: Path) -> None:
    """Drops ``root``'s files from the page cache (a cold start)."""
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- probes (fresh processes)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def probe(directory: str, seq_len: int, microbatch: int, microbatches: int, samples: int, t_spawn: float) -> dict:
    """In a fresh process: import, open the samplers as a replica does, draw ``samples`` microbatches."""
    t0 = time.time()
    import torch  # noqa: F401  (what a replica has imported before it opens its data)

    from recover.config import DataConfig
    from recover.data.sampler import open_samplers

    base = _rss_mb()
    t1 = time.time()
    cfg = DataConfig(path=directory, seq_len=seq_len, microbatch_size=microbatch)
    sampler, _ = open_samplers(cfg, Path(directory), GPT2_VOCAB, microbatches, seed=0)
    t2 = time.time()
    sampler.microbatch(0, 0)
    t3 = time.time()
    step = 10**9 // (microbatches * microbatch) if sampler.num_windows > 10**9 else 1_000  # late steps, epoch > 0
    t4 = time.perf_counter()
    for i in range(samples):
        sampler.microbatch(step + i // microbatches, i % microbatches)
    cost = (time.perf_counter() - t4) / (samples * microbatch)
    return {"startup_s": t3 - t_spawn, "imports_s": t1 - t0, "open_s": t2 - t1, "first_s": t3 - t2,
            "sampler_mb": _rss_mb() - base, "sample_us": cost * 1e6, "windows": sampler.num_windows}


def wait_probe(directory: str, prefetch: int, latency_ms: float, device_ms: float, steps: int, share: int) -> dict:
    """In a fresh process: a replica's loop of ``steps`` steps over its ``share`` microbatches (see the module
    docstring); the training thread's wait for data per step and the step time."""
    import statistics

    from recover.config import DataConfig
    from recover.data.prefetch import Prefetcher
    from recover.data.sampler import open_samplers

    cfg = DataConfig(path=directory, seq_len=SEQ_LEN, microbatch_size=MICROBATCH)
    sampler, _ = open_samplers(cfg, Path(directory), GPT2_VOCAB, 2 * share, seed=0)

    def read(step: int, mb: int) -> Any:
        if latency_ms:
            time.sleep(latency_ms / 1e3)
        return sampler.microbatch(step, mb)

    reads = Prefetcher(read, steps=prefetch)
    mine = list(range(share))
    waits, times = [], []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            for ahead in range(step, step + prefetch + 1):
                reads.ahead(ahead, mine)
            for mb in mine:
                reads.get(step, mb)
                time.sleep(device_ms / 1e3)  # the device computes the microbatch
            waits.append(reads.take().wait_s)
            times.append(time.perf_counter() - t0)
    finally:
        reads.close()
    return {"wait_ms": statistics.median(waits) * 1e3, "step_ms": statistics.median(times) * 1e3}


def materialised_probe(windows: int) -> dict:
    """In a fresh process: the epoch order as a materialised permutation, and as the keyed shuffle."""
    import numpy as np

    from recover.data.shuffle import Shuffle

    base = _rss_mb()
    t0 = time.perf_counter()
    perm = np.random.default_rng([0, 0]).permutation(windows)
    perm_s = time.perf_counter() - t0
    perm_mb = _rss_mb() - base
    del perm
    base = _rss_mb()
    t0 = time.perf_counter()
    shuffle = Shuffle(windows, (0, 0, 0))
    shuffle(np.arange(8))
    return {"windows": windows, "perm_s": perm_s, "perm_mb": perm_mb,
            "shuffle_s": time.perf_counter() - t0, "shuffle_mb": _rss_mb() - base}


def _run_probe(args: Sequence[str], timeout_s: float = 600) -> dict:
    t_spawn = time.time()
    out = subprocess.run([sys.executable, "-m", "recover.bench.data", *args, "--t-spawn", repr(t_spawn)],
                         capture_output=True, text=True, timeout=timeout_s, env=child_env())
    if out.returncode != 0:
        raise RuntimeError(f"probe {' '.join(args)} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the benchmark


def startup(datasets: dict[str, Path], rounds: int, samples: int, log: Log) -> dict[str, dict]:
    """Cold start-up, memory and cost per sample of each dataset, ``rounds`` times in alternating order."""
    runs: dict[str, list[dict]] = {name: [] for name in datasets}
    for r, order in enumerate(round_orders(list(datasets), rounds)):
        for name in order:
            evict(datasets[name])
            res = _run_probe(["probe", str(datasets[name]), "--seq-len", str(SEQ_LEN), "--microbatch-size",
                              str(MICROBATCH), "--microbatches", str(MICROBATCHES), "--samples", str(samples)])
            log(f"[bench data] round {r}: {name}: start-up {res['startup_s']:.2f} s (open {res['open_s']:.3f} s), "
                f"sampler {res['sampler_mb']:.1f} MB, {res['sample_us']:.1f} us/sample")
            runs[name].append(res)
    out = {}
    for name, rs in runs.items():
        out[name] = {key: median([r[key] for r in rs]) for key in ("startup_s", "open_s", "first_s", "imports_s",
                                                                   "sampler_mb", "sample_us")}
        out[name]["windows"] = rs[0]["windows"]
        out[name]["runs"] = rs
    smallest = min(out, key=lambda n: out[n]["windows"])
    for res in out.values():
        res["vs_smallest"] = res["startup_s"] / out[smallest]["startup_s"]
    return out


def data_wait(directory: Path, rounds: int, latency_ms: float, device_ms: float, log: Log) -> list[dict]:
    """The training thread's wait for data per step, prefetch 0 against 2, local and with ``latency_ms``."""
    configs = [(p, lat) for lat in sorted({0.0, latency_ms}) for p in (0, 2)]
    names = [f"prefetch {p}, +{lat:g} ms" for p, lat in configs]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for order in round_orders(names, rounds):
        for name in order:
            prefetch, lat = configs[names.index(name)]
            evict(directory)
            res = _run_probe(["wait", str(directory), "--prefetch", str(prefetch), "--latency-ms", str(lat),
                              "--device-ms", str(device_ms), "--steps", str(WAIT_STEPS), "--share", str(WAIT_SHARE)])
            log(f"[bench data] {name}: wait {res['wait_ms']:.2f} ms of a {res['step_ms']:.0f} ms step")
            runs[name].append(res)
    out = []
    for (prefetch, lat), name in zip(configs, names, strict=True):
        wait, step = median([r["wait_ms"] for r in runs[name]]), median([r["step_ms"] for r in runs[name]])
        out.append({"prefetch": prefetch, "latency_ms": lat, "device_ms": device_ms, "wait_ms": wait,
                    "step_ms": step, "wait_share": wait / step, "runs": runs[name]})
    return out


def text_corpus(root: Path, megabytes: float) -> Path:
    """``megabytes`` of the standard library's ``.py`` sources under ``root`` (copied as often as needed)."""
    import sysconfig

    want = int(megabytes * 1e6)
    done = root / ".complete"
    if done.is_file() and done.read_text() == str(want):
        return root
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(stdlib.rglob("*.py")) if not {"site-packages", "test", "tests"} & set(p.parts)]
    total, copy = 0, 0
    while total < want:
        for src in files:
            if total >= want:
                break
            dst = root / f"copy{copy}" / src.relative_to(stdlib)
            dst.parent.mkdir(parents=True, exist_ok=True)
            data = src.read_bytes()
            dst.write_bytes(data)
            total += len(data)
        copy += 1
    done.write_text(str(want))
    return root


def bpe_tokenizer(path: Path, corpus: Path) -> Path | None:
    """A byte-level BPE of 16,384 ids trained on ``corpus``'s first copy (None without ``tokenizers``)."""
    if path.is_file():
        return path
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        return None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16384, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted((corpus / "copy0").rglob("*.py"))], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def prepare_throughput(root: Path, megabytes: float, rounds: int, tokenizer: str | None, log: Log) -> dict:
    """``recover prepare`` with one worker against every core (see the module docstring)."""
    import shutil

    from recover.data.prepare import prepare_files

    corpus = text_corpus(root / "corpus", megabytes)
    cores = len(os.sched_getaffinity(0))
    bpe = tokenizer or (str(p) if (p := bpe_tokenizer(root / "bpe.json", corpus)) else None)
    runs: dict[tuple[str, int], list[dict]] = {}

    def once(tok: str, workers: int) -> None:
        out = root / "out"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        meta = prepare_files([corpus], out, tokenizer=tok, workers=workers, quiet=True)
        wall = time.perf_counter() - t0
        tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
        res = {"wall_s": wall, "mb_s": megabytes / wall, "tokens_s": tokens / wall}
        runs.setdefault((tok, workers), []).append(res)
        log(f"[bench data] prepare {Path(tok).name} x{workers}: {res['mb_s']:.2f} MB/s, "
            f"{res['tokens_s']:,.0f} tokens/s")

    for r in range(rounds if bpe else 0):
        for workers in ((1, cores) if r % 2 == 0 else (cores, 1)):
            once(bpe, workers)
    for workers in (1, cores):
        once("byte", workers)
    shutil.rmtree(root / "out", ignore_errors=True)
    rows = []
    for (tok, workers), rs in runs.items():
        rows.append({"tokenizer": "byte" if tok == "byte" else f"BPE ({Path(tok).name})", "workers": workers,
                     "mb_s": median([r["mb_s"] for r in rs]), "tokens_s": median([r["tokens_s"] for r in rs]),
                     "runs": rs})
    for row in rows:
        single = next(r for r in rows if r["tokenizer"] == row["tokenizer"] and r["workers"] == 1)
        row["vs_one"] = row["tokens_s"] / single["tokens_s"]
        row["mb_s_per_core"] = row["mb_s"] / row["workers"]
    return {"megabytes": megabytes, "cores": cores, "rows": rows,
            "skipped": None if bpe else "no BPE: pass --tokenizer FILE or install the hf extra (tokenizers)"}


def run(out: Path, sizes: Sequence[int], rounds: int, samples: int, huge: bool, perm_sizes: Sequence[int],
        latency_ms: float = LATENCY_MS, device_ms: float = DEVICE_MS, prepare_mb: float = PREPARE_MB,
        tokenizer: str | None = None, log: Log = stderr_log) -> dict[str, Any]:
    load_before = machine_load()
    data_root = out / "data"
    datasets: dict[str, Path] = {}
    for tokens in sizes:
        datasets[f"{tokens:.0e} tokens"] = make_dataset(data_root / f"tokens_{tokens}", tokens, SHARD_TOKENS)
    if huge:
        tokens = HUGE_WINDOWS * SEQ_LEN + 1
        datasets["W=1e10 windows"] = make_dataset(data_root / "windows_1e10", tokens, HUGE_SHARD_TOKENS)
    log(f"[bench data] datasets under {data_root}: {', '.join(datasets)}")
    result: dict[str, Any] = {
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_before": load_before},
        "seq_len": SEQ_LEN, "microbatch_size": MICROBATCH, "rounds": rounds,
        "startup": startup(datasets, rounds, samples, log),
        "materialised": [_run_probe(["materialised", str(w)]) for w in perm_sizes],
        "data_wait": data_wait(datasets[f"{max(sizes):.0e} tokens"], rounds, latency_ms, device_ms, log),
        "prepare": prepare_throughput(out / "prepare", prepare_mb, rounds, tokenizer, log) if prepare_mb else None,
    }
    result["machine"]["load_after"] = machine_load()
    write_json(out / "results.json", result)
    plot(result, out / "data.png")
    return result


def print_tables(result: dict[str, Any]) -> None:
    m = result["machine"]
    rows = [[name, f"{r['windows']:.2e}", fmt(r["startup_s"], ".2f"), fmt(r["vs_smallest"], ".2f"),
             fmt(r["open_s"] * 1e3, ".1f"), fmt(r["sampler_mb"], ".1f"), fmt(r["sample_us"], ".1f")]
            for name, r in result["startup"].items()]
    print_rich_table(f"recover bench data: cold start-up to the first microbatch (medians of {result['rounds']} "
                     "rounds, fresh processes)",
                     ["dataset", "windows W", "start-up s", "vs smallest", "open ms", "sampler MB", "us/sample"], rows,
                     notes=[f"machine: {m['cores']} cores, {m['platform']}, load {m['load_before']} -> "
                            f"{m['load_after']}; seq_len {result['seq_len']}, microbatch {result['microbatch_size']}"])
    rows = [[f"{r['windows']:.0e}", fmt(r["perm_s"], ".2f"), fmt(r["perm_mb"], ".0f"), fmt(r["shuffle_s"] * 1e3, ".2f"),
             fmt(r["shuffle_mb"], ".1f")] for r in result["materialised"]]
    print_rich_table("the epoch order: a materialised permutation (before) against the keyed shuffle (now)",
                     ["windows", "permutation s", "permutation MB", "shuffle ms", "shuffle MB"], rows)
    rows = [[f"prefetch {r['prefetch']}", fmt(r["latency_ms"], "g"), fmt(r["wait_ms"], ".2f"), fmt(r["step_ms"], ".0f"),
             f"{100 * r['wait_share']:.2f}%"] for r in result["data_wait"]]
    print_rich_table(f"data wait per step: {WAIT_SHARE} microbatches of {result['data_wait'][0]['device_ms']:g} ms "
                     "each (emulated device), medians", ["reads", "+latency ms", "wait ms", "step ms", "wait share"],
                     rows)
    prep = result.get("prepare")
    if prep:
        rows = [[r["tokenizer"], str(r["workers"]), fmt(r["mb_s"], ".2f"), fmt(r["mb_s_per_core"], ".2f"),
                 f"{r['tokens_s']:,.0f}", fmt(r["vs_one"], ".2f")] for r in prep["rows"]]
        print_rich_table(f"recover prepare on {prep['megabytes']:g} MB of text: one worker against {prep['cores']} "
                         f"(medians of {len(prep['rows'][0]['runs'])} for the BPE)",
                         ["tokenizer", "workers", "MB/s", "MB/s per core", "tokens/s", "vs 1 worker"], rows,
                         notes=[prep["skipped"]] if prep["skipped"] else [])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = sorted(result["startup"].values(), key=lambda r: r["windows"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    w = [r["windows"] for r in st]
    a.plot(w, [r["startup_s"] for r in st], "o-", label="start-up to first microbatch")
    a.plot(w, [r["open_s"] for r in st], "s-", label="open (launch checks + sampler)")
    a.set(xscale="log", xlabel="windows W", ylabel="seconds (cold page cache)", title="start-up")
    a.legend()
    b.plot(w, [max(r["sampler_mb"], 0.01) for r in st], "o-", label="keyed shuffle (now)")
    perm = result["materialised"]
    b.plot([r["windows"] for r in perm], [r["perm_mb"] for r in perm], "x--", label="materialised permutation")
    b.set(xscale="log", yscale="log", xlabel="windows W", ylabel="resident MB", title="sampler memory")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated numbers such as 1e7,1e9") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: expected positive numbers such as 1e7,1e9")
    return values


def run_from_args(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.samples < 1:
        raise ConfigError("--rounds and --samples must be >= 1")
    sizes = _positive_ints(args.sizes, "--sizes")
    perm = _positive_ints(args.perm_sizes, "--perm-sizes") if args.perm_sizes else []
    if args.latency_ms < 0 or args.device_ms <= 0:
        raise ConfigError("--latency-ms must be >= 0 and --device-ms > 0")
    if args.prepare_mb < 0:
        raise ConfigError("--prepare-mb must be >= 0 (0 leaves the prepare runs out)")
    result = run(Path(args.out), sizes, args.rounds, args.samples, not args.no_huge, perm, args.latency_ms,
                 args.device_ms, args.prepare_mb, args.tokenizer)
    print_tables(result)
    if args.json:
        write_json(args.json, result)
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``recover bench data`` (sets ``func`` to :func:`run_from_args`)."""
    p = bench_subparsers.add_parser(
        "data", help="data path at scale: start-up, sampler memory and cost up to W = 1e10 windows",
        description="Writes sparse llm.c datasets of growing size (up to W = 1e10 windows; holes, so they fit the "
                    "disk) and measures, in fresh processes with a cold page cache, the start-up to the first "
                    "microbatch, the sampler's resident memory and its cost per sample; and the materialised "
                    "permutation recover used to hold, for comparison.")
    p.add_argument("--out", default="bench-data", help="output directory (datasets are kept in OUT/data and reused)")
    p.add_argument("--sizes", default=",".join(f"{s:.0e}" for s in SIZES),
                   help="training tokens of each dataset, comma-separated (default 1e7,1e9,1e10)")
    p.add_argument("--no-huge", action="store_true", help="leave out the W = 1e10 dataset (9,537 sparse shards)")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"cold starts per dataset (default {ROUNDS})")
    p.add_argument("--samples", type=int, default=SAMPLES, help=f"microbatches drawn per probe (default {SAMPLES})")
    p.add_argument("--perm-sizes", default=",".join(f"{s:.0e}" for s in PERM_SIZES),
                   help="W at which to time the materialised permutation ('' for none; default 1e6,1e7,1e8)")
    p.add_argument("--latency-ms", type=float, default=LATENCY_MS,
                   help=f"added to every read in the data-wait runs: shared storage (default {LATENCY_MS:g})")
    p.add_argument("--device-ms", type=float, default=DEVICE_MS,
                   help=f"emulated compute per microbatch in the data-wait runs (default {DEVICE_MS:g})")
    p.add_argument("--prepare-mb", type=float, default=PREPARE_MB,
                   help=f"MB of text for the recover prepare runs (default {PREPARE_MB:g}; 0: none)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json for the prepare runs (default: a BPE trained here, with the hf extra)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run_from_args)
    return p


def _main(argv: Sequence[str]) -> int:
    """The probes, run as ``python -m recover.bench.data probe|materialised ...``."""
    p = argparse.ArgumentParser(prog="recover.bench.data")
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("probe")
    a.add_argument("directory")
    for name in ("--seq-len", "--microbatch-size", "--microbatches", "--samples"):
        a.add_argument(name, type=int, required=True)
    b = sub.add_parser("materialised")
    b.add_argument("windows", type=int)
    c = sub.add_parser("wait")
    c.add_argument("directory")
    for name, typ in (("--prefetch", int), ("--latency-ms", float), ("--device-ms", float), ("--steps", int),
                      ("--share", int)):
        c.add_argument(name, type=typ, required=True)
    for q in (a, b, c):
        q.add_argument("--t-spawn", type=float, default=None)
    args = p.parse_args(argv)
    if args.what == "probe":
        res = probe(args.directory, args.seq_len, args.microbatch_size, args.microbatches, args.samples,
                    args.t_spawn or time.time())
    elif args.what == "wait":
        res = wait_probe(args.directory, args.prefetch, args.latency_ms, args.device_ms, args.steps, args.share)
    else:
        res = materialised_probe(args.windows)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
