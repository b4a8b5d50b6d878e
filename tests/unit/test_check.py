"""``recover check`` and ``make gpu-check``'s pure parts: the rows built from versions and from probe results
(GPUs as H100s of several kinds report them, failures, timeouts), the one-line verdict, the fingerprint,
the stage plan on a CPU and on a GPU, and the report. The processes themselves run in
tests/e2e/test_check_command.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import refusal
from recover.ops import check, gpucheck
from recover.ops.check import FAIL, INFO, OK, WARN, Outcome
from recover.ops.probes import bit_fingerprint, matmul_size

CPU_HOST = {"python": "3.11.7", "executable": "/usr/bin/python3", "torch": "2.13.0+cpu", "cuda": None, "nccl": None,
            "shrink": False, "abort": None, "gpus": 0, "cpus": 2, "visible": None}
GPU_HOST = {**CPU_HOST, "torch": "2.13.0+cu128", "cuda": "12.8", "nccl": [2, 27, 5], "shrink": True, "abort": True,
            "gpus": 1}


def gpu_result(name: str = "NVIDIA H100 80GB HBM3", tflops: float = 750, gbs: float = 2900, **kw: object) -> dict:
    return {"name": name, "uuid": "a1-b2", "total_gb": 79.1, "free_gb": 78.6, "capability": [9, 0], "sms": 132,
            "matmul_n": 8192, "matmul_flops": tflops * 1e12, "copy_gb": 1.0, "copy_bytes_per_s": gbs * 1e9,
            "nccl": {"ok": True, "connect_ms": 310.0, "abort_ms": 2.0}, **kw}


def by_check(rows: list[check.Row]) -> dict[str, check.Row]:
    return {r.check: r for r in rows}


def test_a_cpu_host_is_information_not_failure() -> None:
    rows = check.version_rows(CPU_HOST)
    assert all(r.status == INFO for r in rows)
    assert check.verdict(rows) == (0, None)


def test_a_gpu_host_needs_nccl_and_its_abort() -> None:
    rows = by_check(check.version_rows(GPU_HOST))
    assert rows["NCCL"].result == "2.27.5" and rows["NCCL shrink"].result == "yes" and rows["NCCL abort"].status == OK
    no_nccl = check.version_rows({**GPU_HOST, "nccl": None, "shrink": False, "abort": None})
    code, line = check.verdict(no_nccl)
    assert code == 1 and "this torch has no NCCL" in line
    no_abort = by_check(check.version_rows({**GPU_HOST, "abort": False}))
    assert no_abort["NCCL abort"].status == FAIL


def test_an_h100_near_its_peak_passes_with_its_percentages() -> None:
    rows = by_check(check.gpu_rows(0, Outcome(result=gpu_result()), {}, 60))
    assert rows["GPU 0 bf16 matmul"].status == OK and rows["GPU 0 bf16 matmul"].peak == "76% of 989 TFLOP/s"
    assert rows["GPU 0 memory copy"].peak == "87% of 3,350 GB/s"
    assert rows["GPU 0 NCCL, 1 rank"].status == OK and "abort 2 ms" in rows["GPU 0 NCCL, 1 rank"].result


def test_an_h100_nvl_is_measured_against_its_own_peak() -> None:
    rows = by_check(check.gpu_rows(0, Outcome(result=gpu_result("NVIDIA H100 NVL", tflops=700)), {}, 60))
    assert rows["GPU 0 bf16 matmul"].peak == "84% of 835 TFLOP/s"


def test_a_slow_gpu_a_mig_slice_and_a_power_cap_are_warnings_not_failures() -> None:
    smi = {"a1-b2": {"uuid": "GPU-A1-B2", "mig.mode.current": "Enabled", "power.limit": "400.00",
                     "power.max_limit": "700.00", "driver_version": "570.86"}}
    rows = by_check(check.gpu_rows(0, Outcome(result=gpu_result(tflops=300)), smi, 60))
    assert rows["GPU 0 bf16 matmul"].status == WARN and "30% of its peak" in rows["GPU 0 bf16 matmul"].problem
    assert rows["GPU 0 MIG"].status == WARN and rows["GPU 0 power"].status == WARN
    assert rows["GPU 0 driver"].result == "570.86"
    assert check.verdict(list(rows.values())) == (0, None)


def test_a_gpu_whose_probe_hangs_fails_in_one_line() -> None:
    rows = check.gpu_rows(1, Outcome(timed_out=True, error="timed out"), {}, 60)
    code, line = check.verdict(rows)
    assert code == 1 and line.startswith("GPU 1 could not be measured (timed out after 60 s)")


def test_an_nccl_all_reduce_that_times_out_names_the_gpus_and_what_to_check() -> None:
    ok = Outcome(result={"ok": True, "expected": 3.0, "got": 3.0, "ms": 1.0, "bytes": 2**28, "bus_bytes_per_s": 1e11})
    row = check.allreduce_row("NCCL all-reduce, GPUs 0,1", "the NCCL all-reduce across GPUs 0,1",
                              [ok, Outcome(timed_out=True)], 60, "check NVLink/IB, rerun with NCCL_DEBUG=INFO")
    assert row.status == FAIL
    assert row.problem == ("the NCCL all-reduce across GPUs 0,1 timed out after 60 s: check NVLink/IB, rerun with "
                           "NCCL_DEBUG=INFO")
    good = check.allreduce_row("gloo", "gloo", [ok, ok], 60, "")
    assert good.status == OK and good.result == "ok: 256 MiB in 1.0 ms, bus 100.0 GB/s"
    wrong = check.allreduce_row("gloo", "the gloo all-reduce", [ok, Outcome(result={**ok.result, "ok": False,
                                                                                    "got": 2.0})], 60, "fix it")
    assert wrong.problem == "the gloo all-reduce gave 2 instead of 3: fix it"


def test_determinism_fails_on_different_fingerprints_and_warns_without_deterministic_kernels() -> None:
    def run(fp: str, on: bool = True) -> Outcome:
        return Outcome(result={"fp": fp, "config": "125m", "dtype": "bfloat16", "device": "cuda",
                               "deterministic_algorithms": on})
    assert check.determinism_row([run("ab"), run("ab")], 60).status == OK
    assert check.determinism_row([run("ab", False), run("ab", False)], 60).status == WARN
    row = check.determinism_row([run("ab"), run("cd")], 60)
    assert row.status == FAIL and "differs between two processes (ab vs cd)" in row.problem


def test_the_verdict_is_one_line_naming_the_first_failure() -> None:
    rows = [check.Row("a", "x"), check.Row("b", "y", status=FAIL, problem="b broke"),
            check.Row("c", "z", status=FAIL, problem="c broke")]
    code, line = check.verdict(rows)
    assert code == 1 and line == "b broke (and 1 more failed row(s): see the table)" and "\n" not in line


def test_each_gpu_probe_sees_the_gpu_this_process_calls_by_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert check.visible_ids(2) == ["4", "6"]
    assert check.gpu_env(check.visible_ids(2), 1) == {"CUDA_VISIBLE_DEVICES": "6"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert check.visible_ids(2) == ["0", "1"]
    assert check.uuid_key("GPU-A1-B2") == check.uuid_key("a1-b2")


def test_the_gradient_fingerprint_changes_with_any_bit() -> None:
    a = [torch.ones(4), torch.zeros(3)]
    b = [torch.ones(4), torch.zeros(3)]
    assert bit_fingerprint(a) == bit_fingerprint(b)
    b[1].view(torch.int32)[2] ^= 1  # the smallest subnormal
    assert bit_fingerprint(a) != bit_fingerprint(b)
    assert bit_fingerprint([a[1], a[0]]) != bit_fingerprint(a)  # moving values between tensors counts


def test_the_matmul_shrinks_to_a_gpu_with_little_free_memory() -> None:
    assert matmul_size(8192, 80 * 2**30) == 8192
    assert matmul_size(8192, 2**30) == 4096  # 3 bf16 matrices in a quarter of it


@pytest.mark.parametrize(("args", "message"), [(["--timeout", "0"], "--timeout 0.0 is not allowed: give seconds > 0"),
                                              (["--matmul-size", "64"], "--matmul-size 64 is too small")])
def test_bad_flags_are_refused_in_one_line_before_anything_starts(args: list[str], message: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, err = refusal(["check", *args], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


# ---------------------------------------------------------------- make gpu-check

def test_on_a_cpu_the_gpu_stages_are_skipped_with_their_reason(tmp_path: Path) -> None:
    stages = {s.key: s for s in gpucheck.plan("cpu", tmp_path)}
    assert list(stages) == ["check", "e2e-gpu", "bench-compiled", "bench-eager"]
    assert "no CUDA GPU" in stages["bench-compiled"].skip
    smoke = stages["bench-eager"].cmd
    assert "--device" in smoke and "debug" in smoke and "--no-kill" not in smoke  # the rejoin runs on gloo here
    assert "--determinism" in stages["check"].cmd


def test_on_a_gpu_both_presets_run_compiled_and_eager_with_one_kill_run(tmp_path: Path) -> None:
    stages = {s.key: s for s in gpucheck.plan("cuda", tmp_path)}
    assert not any(s.skip for s in stages.values())
    compiled, eager = stages["bench-compiled"].cmd, stages["bench-eager"].cmd
    assert "125m,1b" in compiled and "--compile" in compiled and "--no-kill" in compiled
    assert "125m,1b" in eager and "--no-compile" in eager and "--kill" in eager
    assert sum(s.timeout_s for s in stages.values()) <= 80 * 60  # limits, not the expected ~15 min
    missing = gpucheck.plan("cuda", tmp_path, e2e=tmp_path / "none.py")
    assert "not found" in missing[1].skip


def test_quick_fits_a_short_lease_with_125m_eager_and_its_kill(tmp_path: Path) -> None:
    stages = {s.key: s for s in gpucheck.plan("cuda", tmp_path, quick=True)}
    assert stages["bench-compiled"].skip == "--quick" and not stages["e2e-gpu"].skip
    eager = stages["bench-eager"].cmd
    assert eager[eager.index("--presets") + 1] == "125m" and "--kill" in eager


def test_the_report_records_passes_skips_and_a_failure_with_its_log(tmp_path: Path) -> None:
    stages = gpucheck.plan("cpu", tmp_path)
    (tmp_path / "e2e-gpu.log").write_text("SKIPPED [1] tests/e2e/test_gpu.py:37: needs a CUDA GPU\n"
                                          "3 skipped in 2.1s\n")
    (tmp_path / "bench-eager.log").write_text("Traceback\nRuntimeError: the plain loop of debug exited 1\n")
    (tmp_path / "check.json").write_text('{"host": {"torch": "2.13.0+cpu", "cuda": null, "nccl": null}, "rows": '
                                         '[{"check": "gloo all-reduce", "result": "ok | fast", "peak": "", '
                                         '"status": "ok", "problem": null}], "failure": null}')
    done = [gpucheck.Done(stages[0], gpucheck.PASSED, 12.0, 0), gpucheck.Done(stages[1], gpucheck.PASSED, 5.0, 0),
            gpucheck.Done(stages[2], gpucheck.SKIPPED), gpucheck.Done(stages[3], gpucheck.FAILED, 130.0, 1)]
    text = gpucheck.render(done, [], tmp_path, "cpu", 150.0)
    assert text.startswith("# recover gpu-check: FAILED: bench-eager")
    assert "2 passed, 1 failed, 1 skipped" in text and "torch 2.13.0+cpu, CUDA none" in text
    assert "| gloo all-reduce | ok \\| fast |  | ok |" in text  # a cell's | is escaped
    assert "SKIPPED [1] tests/e2e/test_gpu.py:37: needs a CUDA GPU" in text and "3 skipped in 2.1s" in text
    assert "Skipped: no CUDA GPU" in text and "2 min 10 s" in text
    assert "RuntimeError: the plain loop of debug exited 1" in text  # the failed stage's log tail
    partial = gpucheck.render(done[:1], stages[1:], tmp_path, "cpu", 12.0)
    assert partial.startswith("# recover gpu-check: running") and "3 not run yet" in partial


def test_an_interpreter_without_recovers_dependencies_is_named_before_any_stage() -> None:
    assert gpucheck.missing_modules(("json", "no_such_module_here")) == ["no_such_module_here"]
    assert gpucheck.missing_modules() == []  # this environment has them all
