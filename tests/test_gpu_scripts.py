"""The GPU diagnostics' arithmetic, on hand-made inputs (the measurements themselves need a GPU):
scripts/block_profile.py's split of an instruction's time (simexec.trace.profiler), scripts/gpu_profile.py's
planning cost and kernel fit (simexec.calibrate.gpu_kernels)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from simexec.calibrate import device_memory
from simexec.calibrate.gpu_kernels import fit_kernel_profile, plan_costs
from simexec.trace.profiler import block_instances, gemm_shapes


def _x(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_block_profile_splits_the_last_instance_of_each_instruction():
    """Two steps of `fwd.experts.L0.m0`: only the last counts. Its range holds a GEMM launched through
    the driver and a copy through the runtime (both matched to their kernels by correlation id), a
    synchronising copy and a cudaMalloc; an operator outside the range is not its."""
    events = [
        _x("user_annotation", "fwd.experts.L0.m0", 0, 50),  # step 0
        _x("cpu_op", "aten::mm", 10, 30),
        _x("user_annotation", "fwd.experts.L0.m0", 1000, 400),  # step 1
        _x("cpu_op", "aten::mm", 1010, 200),
        _x("cuda_driver", "cuLaunchKernelEx", 1190, 10, correlation=7),
        _x("cpu_op", "aten::split", 1250, 100),
        _x("cuda_runtime", "cudaMemcpyAsync", 1260, 80, correlation=8),
        _x("cuda_runtime", "cudaMalloc", 1350, 20, correlation=9),
        _x("kernel", "nvjet_gemm", 1300, 60, correlation=7),
        _x("gpu_memcpy", "Memcpy DtoH", 1340, 5, correlation=8),
        _x("cpu_op", "aten::add", 1500, 10),  # after the range
        _x("user_annotation", "bwd.fc1.L0.m0", 1400, 10),  # another block
    ]
    [row] = block_instances(events, "experts")
    assert row["name"] == "fwd.experts.L0.m0" and row["host_us"] == 400 and row["ops"] == 2
    assert row["kernels"] == 2 and row["kernel_us"] == 65
    assert row["device_span_us"] == 60 and row["gap_before_first_kernel_us"] == 300
    assert row["sync_us"] == 80 and row["alloc_us"] == 20 and row["allocs"] == 1
    assert row["top_ops"][0] == ("aten::mm", 200)


def test_block_profile_splits_the_blocks_gemms_by_whether_their_shape_was_met():
    """Over the whole run, in time order: a GEMM counts as `new` the first time its dimensions and
    strides appear inside the block, `met` after; GEMMs outside the block's ranges are not counted."""
    def mm(ts, dims, dur):
        return _x("cpu_op", "aten::mm", ts, dur, **{"Input Dims": dims, "Input Strides": [[1, 1], [1, 1]]})

    events = [
        _x("user_annotation", "fwd.experts.L0.m0", 0, 100), mm(10, [[5, 8], [8, 4]], 40), mm(60, [[5, 8], [8, 4]], 9),
        _x("user_annotation", "fwd.experts.L0.m1", 200, 100), mm(210, [[7, 8], [8, 4]], 41), mm(260, [[5, 8], [8, 4]], 8),
        mm(400, [[9, 8], [8, 4]], 50),  # outside every experts range
    ]
    assert gemm_shapes(events, "experts") == {"met": [9, 8], "new": [40, 41]}


def test_gemm_plan_cost_is_a_new_shape_less_a_repeated_one_per_dtype():
    rows = [{"dtype": dt, "case": case, "median_us": us} for dt, case, us in (
        ("bf16", "repeat", 16.0), ("bf16", "repeat", 20.0), ("bf16", "new_rows", 130.0), ("bf16", "new_inner", 110.0),
        ("fp32", "repeat", 30.0), ("fp32", "new_rows", 25.0), ("fp32", "new_inner", 27.0))]
    got = plan_costs(rows)
    assert got["bf16"] == pytest.approx((120.0 - 18.0) * 1e-6)
    assert got["fp32"] == 0.0  # never negative: no planning to see


@pytest.mark.parametrize("name, raw, cluster", [("h100", "h100_raw.json", "dgx-h100"),
                                                 ("h200", "h200_raw.json", "hgx-h200")])
def test_kernel_profiles_come_from_their_recorded_kernels(tmp_path, name, raw, cluster):
    """Each committed GPU kernel profile is what `gpu_profile.py fit` makes of the committed kernel
    timings on its datasheet preset, and it predicts those kernels better than the preset does."""
    root = Path(__file__).resolve().parent.parent
    committed = json.loads((root / "traces/profiles" / f"{name}.json").read_text())
    out = tmp_path / f"{name}.json"
    fit_kernel_profile(str(root / "traces/gpu" / raw), cluster, str(out))
    refit = json.loads(out.read_text())
    assert refit["base_cluster"] == committed["base_cluster"] == cluster
    assert refit["measured_at"] == committed["measured_at"]
    for key, value in committed["costs"].items():
        assert refit["costs"][key] == pytest.approx(value, rel=1e-3), key
    assert refit["fit"]["mape_fitted"] < 0.6 * refit["fit"]["mape_datasheet"]


def test_device_memory_refuses_a_machine_without_cuda_in_one_line():
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "device_memory.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    assert out.stderr.strip() == "device_memory.py: no CUDA device here" and "Traceback" not in out.stderr


def test_device_memory_keeps_one_row_per_gpu(tmp_path):
    """`--out` adds this GPU's row to the file and replaces an earlier one of the same GPU, so
    traces/gpu/device_memory.json is what the script writes, one machine at a time."""
    out = tmp_path / "memory.json"
    device_memory.keep_row(out, {"gpu": "H100", "total_memory_bytes": 1.0})
    device_memory.keep_row(out, {"gpu": "H200", "total_memory_bytes": 2.0})
    device_memory.keep_row(out, {"gpu": "H100", "total_memory_bytes": 3.0})
    got = json.loads(out.read_text())
    assert got["command"] == device_memory.COMMAND
    assert {r["gpu"]: r["total_memory_bytes"] for r in got["rows"]} == {"H100": 3.0, "H200": 2.0}
    committed = json.loads((Path(__file__).resolve().parent.parent / "traces/gpu/device_memory.json").read_text())
    assert committed["command"] == device_memory.COMMAND and all("measured_at" in r for r in committed["rows"])


def test_device_memory_refuses_a_file_not_its_own_in_one_line(tmp_path):
    """A bad `--out` file is named in one line before anything is measured."""
    import subprocess

    bad = tmp_path / "memory.json"
    bad.write_text('{"kernels": []}')
    script = Path(__file__).resolve().parent.parent / "scripts" / "device_memory.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(bad)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"device_memory.py: {bad} is not a device memory file" \
        ' (a JSON object whose "rows" each name a "gpu")'
    assert bad.read_text() == '{"kernels": []}'
    nowhere = tmp_path / "missing" / "memory.json"
    out = subprocess.run([sys.executable, str(script), "--out", str(nowhere)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == \
        f"device_memory.py: {nowhere}: no folder {nowhere.parent} to write it in"
