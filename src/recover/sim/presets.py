"""Named simulator presets, each a :class:`~recover.sim.model.JobSpec` with its assumptions stated.

Contract: :func:`preset` returns a validated spec whose ``notes`` list every assumption behind
its numbers, with the published figure each one comes from (cited in ``docs/BENCHMARKS.md``).
Nothing here is fitted to the result it is compared with.

* ``paper-512``: ReCoVer's "successive failures" scenario (arXiv 2605.11215): 512 GPUs, 256 of
  them lost one replica at a time, evenly spread over a run that ends at 234 GPU-hours; no
  replacements. Compared with the paper's 2.23x throughput and +74.9% tokens at 234 GPU-hours.
* ``llama3-16k``: Llama 3 405B's pre-training job (arXiv 2407.21783): 16,384 H100 in 128 replicas
  of TP8 x PP16, 16M-token steps, 419 unexpected interruptions in 54 days.
* ``131k``: the same model shape weak-scaled to 131,072 GPUs at Kokolis et al.'s projected job
  MTTF of about 0.23 h (HPCA 2025, arXiv 2410.21680), for 30 days.
"""

from __future__ import annotations

from collections.abc import Callable

from recover.errors import ConfigError
from recover.sim.failures import spread_losses
from recover.sim.model import DAY, HOUR, JobSpec

PAPER = {"throughput_ratio": 2.23, "extra_tokens": 0.749, "budget_gpu_h": 234.0}

# Llama 3 405B (arXiv 2407.21783, Table 4 at 16,384 GPUs): TP 8, PP 16, DP 128, 16 sequences of
# 8,192 tokens per data-parallel group per step (16M tokens), about 400 TFLOP/s per GPU.
LLAMA3_STEP_S = round(6 * 405e9 * 2048 * 8192 / (16384 * 400e12), 1)  # 6.2 s
LLAMA3_MTBF_H = 54 * 24 / 419  # 419 unexpected interruptions in 54 days: one every 3.09 h
KOKOLIS_131K_MTTF_H = 0.23

_COMMON_LARGE = (
    "Replica = TP8 x PP16 = 128 GPUs (Llama 3 405B's layout, arXiv 2407.21783 Table 4); M = 16 "
    "microbatches of one 8,192-token sequence per replica, so losing 1 replica makes the survivors "
    "carry 17 instead of 16 (steps 6.25% slower) under the even-split workload policy.",
    f"Step time {LLAMA3_STEP_S} s = 6 x 405e9 params x 16.8M tokens / (16,384 GPUs x 400 TFLOP/s), "
    "weak scaling (the step time does not grow with the job).",
    "Every interruption kills exactly one replica (Llama 3 Table 5: 78% hardware; software, network "
    "and host causes are counted the same way); GPUs fail independently (exponential lifetimes).",
    "Hot spares: a replaced replica is ready 300 s after its failure (repair_s). recover and "
    "shrink-drop run on the survivors meanwhile and take it back at a step boundary, pausing "
    "rejoin_cost_s = 10 s for the state transfer (about 50 GB per GPU over a 400 Gb/s link, plus a "
    "new communicator); checkpoint-restart relaunches onto it ('replace' mode), so its relaunch "
    "lasts max(180 s, 300 s) and the 120 s beyond the relaunch itself are 'waiting'.",
    "checkpoint-restart: synchronous save 30 s, load 60 s, relaunch 180 s (TorchElastic: 'typically "
    "30 secs or even more' for workers alone, pytorch/elastic#99; scheduling and NCCL init of "
    "thousands of ranks take minutes); Young/Daly interval. At 16k this gives about 90% effective "
    "training time, consistent with Llama 3's reported '> 90%'.",
    "recover: recovery latency 5 s per failure (detection by connection loss + new communicator at "
    "thousands of ranks; 0.2-0.5 s measured on 8 gloo ranks, docs/DESIGN.md §11), then the orphans are "
    "recomputed after the survivors' own quotas; no periodic checkpoints.",
    "shrink-drop: the failed step is discarded, reconfiguration 5 s (torchft quorum + new process "
    "group, as fast as recover's), each replica keeps its local batch so steps commit fewer tokens.",
)


def paper_512(replica_gpus: int = 32) -> JobSpec:
    """ReCoVer's 512-GPU scenario: 256 GPUs lost, one replica at a time, over 234 GPU-hours.

    ``replica_gpus`` (a power of two from 1 to 256) sets the failure unit, hence how many
    failures lose the 256 GPUs (8 with the default 32-GPU replicas).
    """
    gpus, lost, budget = 512, 256, PAPER["budget_gpu_h"]
    if replica_gpus not in {2**i for i in range(9)}:
        raise ConfigError(f"paper-512 replica size = {replica_gpus} GPUs must be a power of two from 1 to 256")
    trace = spread_losses(gpus, replica_gpus, lost, budget, seed=0)
    tp = min(8, replica_gpus)
    return JobSpec(
        gpus=gpus, tp=tp, pp=replica_gpus // tp, microbatches=256,
        tokens_per_microbatch=4096, step_time_s=10.0, duration_s=2 * HOUR, budget_gpu_h=budget,
        failures="trace", trace=trace, rejoin=False, restart_mode="survivors",
        recovery_latency_s=2.0, save_s=20.0, load_s=20.0, restart_s=60.0, reconfig_s=2.0,
        notes=(
            f"512 GPUs in {gpus // replica_gpus} replicas of {replica_gpus} GPUs (TP{tp} x PP{replica_gpus // tp}; "
            "the paper does not give its layout); 256 GPUs lost = "
            f"{lost // replica_gpus} replica failures, evenly spread in time over a run that ends when the "
            "job has held 234 GPU-hours (about 37 min at 384 GPUs on average); lost GPUs are never "
            "replaced, as in the paper's 'successive failures'.",
            "Step time 10 s with all 512 GPUs; M = 256 microbatches of 4,096 tokens (1M tokens per step), "
            "kept constant by recover and checkpoint-restart (survivors carry more microbatches).",
            "checkpoint-restart restarts on the survivors (keeping M by gradient accumulation), "
            "synchronous save 20 s, load 20 s, relaunch 60 s (TorchElastic: kill-and-restart "
            "'typically takes 30 secs or even more', pytorch/elastic#99), Young/Daly interval from the "
            "trace's mean time between failures.",
            "recover: recovery latency 2 s per failure (0.2-0.5 s measured on gloo, docs/DESIGN.md §11; NCCL "
            "communicators at 512 GPUs take longer); orphans recomputed after the survivors' quotas.",
            "shrink-drop: failed step discarded + 2 s reconfiguration; the global batch shrinks.",
            "'Throughput after successive failures' = tokens committed from the first failure to the end "
            "/ that time; '+tokens at 234 GPU-hours' counts the whole run, failure-free start included.",
        ),
    )


def llama3_16k() -> JobSpec:
    """Llama 3 405B's 16,384-GPU job at its published interruption rate, for its 54 days."""
    gpus = 16384
    return JobSpec(
        gpus=gpus, tp=8, pp=16, microbatches=2048, tokens_per_microbatch=8192, step_time_s=LLAMA3_STEP_S,
        duration_s=54 * DAY, failures="exponential", gpu_mttf_h=LLAMA3_MTBF_H * gpus, repair_s=300.0,
        rejoin=True, restart_mode="replace", recovery_latency_s=5.0, rejoin_cost_s=10.0, save_s=30.0,
        load_s=60.0, restart_s=180.0, reconfig_s=5.0,
        notes=(
            "16,384 GPUs, 54 days, 419 unexpected interruptions (Llama 3, arXiv 2407.21783 Table 5): job "
            f"MTBF {LLAMA3_MTBF_H:.2f} h, per-GPU MTTF {LLAMA3_MTBF_H * gpus:,.0f} h.",
            *_COMMON_LARGE,
        ),
    )


def projection_131k() -> JobSpec:
    """Llama 3's layout weak-scaled to 131,072 GPUs at Kokolis et al.'s projected failure rate."""
    gpus = 131072
    return JobSpec(
        gpus=gpus, tp=8, pp=16, microbatches=16384, tokens_per_microbatch=8192, step_time_s=LLAMA3_STEP_S,
        duration_s=30 * DAY, failures="exponential", gpu_mttf_h=KOKOLIS_131K_MTTF_H * gpus, repair_s=300.0,
        rejoin=True, restart_mode="replace", recovery_latency_s=5.0, rejoin_cost_s=10.0, save_s=30.0,
        load_s=60.0, restart_s=180.0, reconfig_s=5.0,
        notes=(
            "131,072 GPUs for 30 days at Kokolis et al.'s projected job MTTF of 0.23 h (HPCA 2025, "
            f"arXiv 2410.21680; measured 7.9 h at 1,024 GPUs): per-GPU MTTF {KOKOLIS_131K_MTTF_H * gpus:,.0f} h.",
            "1,024 replicas, M = 16,384 (a 134M-token batch: weak scaling of Llama 3's 16 sequences per "
            "replica); the same costs as llama3-16k (relaunch at 8x the ranks is if anything slower).",
            *_COMMON_LARGE,
        ),
    )


PRESETS: dict[str, Callable[[], JobSpec]] = {
    "paper-512": paper_512,
    "llama3-16k": llama3_16k,
    "131k": projection_131k,
}


def preset(name: str, **overrides: object) -> JobSpec:
    """The named preset with ``overrides`` (JobSpec fields) applied.

    ``paper-512`` rebuilds its failure trace when the replica shape (``tp``, ``pp``, ``shard``)
    changes, so the 256 lost GPUs are still whole replicas.

    Raises:
        ConfigError: an unknown name (lists the known ones) or a bad override.
    """
    if name not in PRESETS:
        raise ConfigError(f"preset = {name!r} is not one of {', '.join(PRESETS)}")
    spec = PRESETS[name]()
    if name == "paper-512" and {"tp", "pp", "shard"} & set(overrides):
        size = 1
        for axis in ("tp", "pp", "shard"):
            value = overrides.get(axis, getattr(spec, axis))
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{axis} = {value!r} must be an integer >= 1")
            size *= value
        spec = paper_512(size)
    unknown = sorted(set(overrides) - set(JobSpec.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown job fields {unknown}; allowed: {', '.join(JobSpec.__dataclass_fields__)}")
    return spec.replace(**overrides) if overrides else spec
