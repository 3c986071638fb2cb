"""A GPU's kernel costs fitted to micro-benchmark timings (`scripts/gpu_profile.py measure` on the GPU):
GEMM and attention efficiency curves, memory and host-link efficiency and launch overhead, fitted by
least squares on log durations; and the host's cost of planning a GEMM of a shape it has not met."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def plan_costs(rows: list[dict]) -> dict[str, float]:
    """Per dtype, the median host time to issue a GEMM of a new shape less that of a repeated one:
    the seconds cuBLAS spends choosing an algorithm."""
    out = {}
    for dt in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dt]
        repeat = statistics.median(r["median_us"] for r in mine if r["case"] == "repeat")
        new = statistics.median(r["median_us"] for r in mine if r["case"] != "repeat")
        out[dt] = max(0.0, new - repeat) * 1e-6
    return out


def predict_kernels(rows: list[dict], cluster) -> list[float]:
    """The cost model's seconds for each measured kernel (simexec.sim.compute with the cluster's costs)."""
    from simexec.sim.compute import ComputeModel

    model = ComputeModel(cluster, "bf16")
    d, c = cluster.device, cluster.costs
    out = []
    for r in rows:
        kind = r["kind"]
        if kind == "gemm":
            # the measured GEMM has no separate memory-bound kernels: its operand traffic is inside eff
            out.append(r["flops"] / (model.peak * model.efficiency("gemm", r["flops"])) + d.launch_overhead_s)
        elif kind.startswith("attention"):
            out.append(r["flops"] / (model.peak * model.efficiency("attention", r["flops"])) + d.launch_overhead_s)
        elif kind == "elementwise":
            out.append(model.time("elementwise", r["flops"], r["bytes"]))
        elif kind in ("h2d", "d2h"):
            out.append(r["bytes"] / (cluster.node.host_link_bw * c.host_link_eff) + d.launch_overhead_s)
        elif kind == "launch":
            out.append(d.launch_overhead_s + r["bytes"] / (d.memory_bw * c.memory_eff))
    return out


def kernel_mape(pred: list[float], rows: list[dict]) -> float:
    return statistics.mean(abs(p - r["seconds"]) / r["seconds"] for p, r in zip(pred, rows))


def fit_kernel_profile(raw_path: str, cluster_name: str, out: str) -> str:
    """Fit the cost model's kernel parameters to `raw_path`'s timings from the `cluster_name` preset,
    write the profile to `out` and return the report: each kernel measured, as the datasheet preset
    predicts it and as the fitted profile does."""
    import numpy as np
    from scipy.optimize import least_squares

    from simexec.specs.cluster import get_cluster
    from simexec.sim.profile import apply_profile
    from simexec.trace.schema import save_json

    raw = json.loads(Path(raw_path).read_text())
    rows = raw["rows"]
    base = get_cluster(cluster_name)
    names = ["gemm_eff", "gemm_half_flops", "attention_eff", "attention_half_flops", "memory_eff",
             "host_link_eff", "launch_overhead_s"]
    c, d = base.costs, base.device
    x0 = np.log([c.gemm_eff, c.gemm_half_flops, c.attention_eff, c.attention_half_flops, c.memory_eff,
                 c.host_link_eff, d.launch_overhead_s])
    lo = np.log([1e-3, 1e3, 1e-3, 1e3, 1e-2, 1e-2, 1e-7])
    hi = np.log([1.0, 1e13, 1.0, 1e13, 1.0, 1.0, 1e-3])
    measured = np.log([r["seconds"] for r in rows])

    def profile_of(x) -> dict:
        v = dict(zip(names, np.exp(x).tolist()))
        launch = v.pop("launch_overhead_s")
        return {"costs": v, "device": {"launch_overhead_s": launch}}

    def residuals(x):
        return np.log(predict_kernels(rows, apply_profile(base, profile_of(x)))) - measured

    sol = least_squares(residuals, np.clip(x0, lo + 1e-9, hi - 1e-9), bounds=(lo, hi), loss="soft_l1", f_scale=0.1)
    prof = profile_of(sol.x)
    fitted = apply_profile(base, prof)
    before, after = predict_kernels(rows, base), predict_kernels(rows, fitted)
    profile = {"name": Path(out).stem, "machine": raw["machine"], "measured_at": raw["machine"]["measured_at"],
               "method": "micro-benchmarks (scripts/gpu_profile.py): bf16 GEMM sweep, SDPA causal attention, "
                         "element-wise, pinned copies, empty kernel; least_squares soft_l1 on log durations",
               "base_cluster": cluster_name, **prof,
               "fit": {"mape_datasheet": kernel_mape(before, rows), "mape_fitted": kernel_mape(after, rows)}}
    save_json(profile, out)
    lines = [f"# {raw['machine']['gpu']}: datasheet preset `{cluster_name}` against measured kernels", "",
             f"Measured {raw['machine']['measured_at']} with torch {raw['machine']['torch']}, CUDA "
             f"{raw['machine']['cuda']}; regenerate with the two commands in `scripts/gpu_profile.py`.", "",
             "| kernel | shape | measured ms | datasheet ms | error | fitted ms | error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r, b, a in zip(rows, before, after):
        m = r["seconds"]
        lines.append(f"| {r['kind']} | {'x'.join(map(str, r['shape']))} | {m * 1e3:.4f} | {b * 1e3:.4f} | "
                     f"{(b - m) / m:+.1%} | {a * 1e3:.4f} | {(a - m) / m:+.1%} |")
    lines += ["", f"Mean absolute percentage error: datasheet {kernel_mape(before, rows):.1%}, fitted "
                  f"{kernel_mape(after, rows):.1%}.", "", "Fitted parameters (datasheet value in brackets):", ""]
    for k, v in prof["costs"].items():
        lines.append(f"- `{k}` = {v:.4g} ({getattr(c, k):.4g})")
    lines.append(f"- `launch_overhead_s` = {prof['device']['launch_overhead_s']:.3g} ({d.launch_overhead_s:.3g})")
    return "\n".join(lines) + "\n"
