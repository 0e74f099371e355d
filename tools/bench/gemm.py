"""The gemm benchmark: y = act(x·Wᵀ + b) through cuBLASLt (kspec.ops.gemm / linear) and its backward
(gemm.bwd), against torch."""
from __future__ import annotations

import math
import sys
import traceback

from .common import TOLERANCE, Section, rel_error, short_error, to_f64
from .report import fmt

FAMILY = "gemm"
DESCRIPTION = "y = act(x·Wᵀ + b) through cuBLASLt and its backward against torch"


# The % column is of the H100 SXM's dense tensor-core peak from NVIDIA's datasheet (no sparsity), in
# TFLOP/s: bf16 and fp16 989.4, tf32 494.7; fp32 without TF32 runs on the CUDA cores, 66.9. peers.md
# measured 794 TFLOP/s for a bf16 torch.matmul; the torch rows of the same run show what is reachable.
H100_DENSE_TFLOPS = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
# TF32 rounds the inputs to 10 mantissa bits: ~1e-3 relative error at k = 4096 (tests use 3e-3).
def gemm_tolerance(dtype: str) -> float:
    """By the gemm rows' dtype names; tf32 inputs (10-bit mantissas) get their own."""
    if dtype == "tf32":
        return 3e-3
    return TOLERANCE[{"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]]

GEMM_RATIO_MIN = 0.95  # kspec's TFLOP/s over torch's for the same op: the goal is ≈ 1.0
GEMM_EPILOGUES = {"none": ("none", False), "bias": ("none", True), "bias+relu": ("relu", True),
                  "bias+gelu": ("gelu", True)}


def add_arguments(p):
    p.add_argument("--peak-tflops", type=float, default=H100_DENSE_TFLOPS["bf16"],
                   help="gemm: bf16/fp16 %% of peak is of this (H100 SXM dense: 989.4)")


def gemm_flops(m: int, n: int, k: int, kind: str) -> int:
    """2mnk for the forward; the backward is two GEMMs of the same size (dx = dpre·W, dW = dpreᵀ·x)."""
    return (2 if kind == "fwd" else 4) * m * n * k


def gemm_min_bytes(m: int, n: int, k: int, kind: str, act: str, bias: bool, esize: int) -> int:
    """Napkin math, each tensor once: fwd reads x (m·k) and W (n·k) (+ b) and writes y (m·n); bwd reads
    dy (m·n), the saved pre-activation with an activation (m·n), x and W, and writes dx (m·k), dW (n·k)
    and db (n). Only the decode shape (m = 8) comes near this floor: the others are compute-bound."""
    if kind == "fwd":
        return esize * (m * k + n * k + m * n + (n if bias else 0))
    return esize * (m * n * (2 if act != "none" else 1) + 2 * m * k + 2 * n * k + (n if bias else 0))


def _gemm_case(ctx, m, n, k, dtype_name, seed):
    torch = ctx.torch
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}[dtype_name]
    g = torch.Generator(device=ctx.dev).manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, device=ctx.dev, generator=g) * scale).to(dt)

    c = {"m": m, "n": n, "k": k, "dtype": dtype_name, "tdtype": dt, "tf32": dtype_name == "tf32",
         "x": rn(m, k), "w": rn(n, k, scale=k ** -0.5), "b": rn(n, scale=0.1), "dy": rn(m, n)}
    # As for norm_act: the first and last check_rows/2 rows are compared with the float64 reference, and
    # the backward's validation call gets a dy that is zero elsewhere (dW, db then equal the reference's
    # over those rows; dx must be exactly zero on every other row).
    r = min(ctx.args.check_rows, m)
    idx = list(range(m)) if r >= m else list(range(r // 2)) + list(range(m - (r - r // 2), m))
    c["idx"] = torch.tensor(idx, device=ctx.dev, dtype=torch.long)
    c["rest"] = torch.ones(m, dtype=torch.bool, device=ctx.dev)
    c["rest"][c["idx"]] = False
    c["dy_check"] = torch.zeros_like(c["dy"])
    c["dy_check"][c["idx"]] = c["dy"][c["idx"]]
    c["xs64"] = to_f64(c["x"][c["idx"]])
    c["w64"] = to_f64(c["w"])
    c["b64"] = to_f64(c["b"])
    from kspec.reference import gemm as ref

    c["xw64"] = ref.gemm_fwd(c["xs64"], c["w64"])[1]  # x·Wᵀ on the checked rows, shared by every epilogue
    return c


def _gemm_fwd_variants(ctx, c, epi):
    torch = ctx.torch
    F = torch.nn.functional
    K = ctx.kspec.ops
    act, has_bias = GEMM_EPILOGUES[epi]
    x, w, tf32 = c["x"], c["w"], c["tf32"]
    b = c["b"] if has_bias else None
    tact = {"none": lambda t: t, "relu": torch.relu, "gelu": lambda t: F.gelu(t, approximate="tanh")}[act]
    v = [("kspec gemm", "kspec", "", lambda: K.gemm(x, w, b, act=act, tf32=tf32)[0], "kspec.ops.gemm (raw op)"),
         ("kspec linear", "kspec", "", lambda: K.linear(x, w, b, act, tf32=tf32), "kspec.ops.linear (custom op)")]
    if act == "none":
        v.append(("torch F.linear", "peer", "same op", lambda: F.linear(x, w, b),
                  "F.linear = torch.matmul(x, w.T)" + (" + b in cuBLASLt's epilogue" if has_bias else "")))
    else:
        v.append(("torch _addmm_activation", "peer", "same op",
                  lambda: torch._addmm_activation(b, x, w.t(), use_gelu=act == "gelu"),
                  "torch._addmm_activation: cuBLASLt's bias+act epilogue (private API)"))
        v.append(("torch F.linear → act", "peer", "unfused", lambda: tact(F.linear(x, w, b)),
                  f"F.linear then {'F.relu' if act == 'relu' else 'F.gelu(tanh)'}: what nn.Linear + activation runs"))
    if has_bias:
        v.append(("torch matmul + b" + (" + act" if act != "none" else ""), "peer", "unfused",
                  lambda: tact(torch.matmul(x, w.t()) + b), "separate kernels: matmul, add, activation"))
    return v


def _gemm_bwd_variants(ctx, c, act, saved):
    torch = ctx.torch
    K = ctx.kspec.ops
    x, w, tf32 = c["x"], c["w"], c["tf32"]

    def torch_bwd(dy):
        dpre = dy if act == "none" else torch.ops.aten.gelu_backward(dy, saved, approximate="tanh")
        return {"dx": dpre @ w, "dw": dpre.t() @ x, "db": dpre.sum(0)}

    def kspec_bwd(dy):
        dx, dw, db = K.gemm_bwd(dy, x, w, saved, act=act, tf32=tf32)
        return {"dx": dx, "dw": dw, "db": db}

    return [("kspec gemm.bwd", "kspec", "", kspec_bwd, "kspec.ops.gemm_bwd (raw op): dx, dW, db"),
            ("torch (autograd's ops)", "peer", "same op", torch_bwd,
             ("" if act == "none" else "aten.gelu_backward, ") + "dpre @ W, dpreᵀ @ x, dpre.sum(0)")]


def _gemm_row(ctx, c, kind, epi, name, impl, role, note, act, has_bias):
    m, n, k = c["m"], c["n"], c["k"]
    esize = c["x"].element_size()
    return {"family": "gemm", "shape": f"{m}x{n}x{k}", "m": m, "n": n, "k": k, "dtype": c["dtype"], "epilogue": epi,
            "kind": kind, "variant": name, "impl": impl, "role": role, "note": note,
            "flops": gemm_flops(m, n, k, kind), "bytes": gemm_min_bytes(m, n, k, kind, act, has_bias, esize),
            "tolerance": gemm_tolerance(c["dtype"]), "status": "", "errors": {}}


def _gemm_time(ctx, row, step, prep=None):
    t = ctx.timer.time(step, prep)
    row.update(t)
    row["tflops"] = row["flops"] / (t["gpu_ms"] * 1e-3) / 1e12
    row["pct_of_peak"] = 100.0 * row["tflops"] / _gemm_peak(ctx, row["dtype"])
    row["gbps"] = row["bytes"] / (t["gpu_ms"] * 1e6)


def _gemm_peak(ctx, dtype_name):
    if dtype_name in ("bf16", "fp16"):
        return ctx.args.peak_tflops
    return H100_DENSE_TFLOPS[dtype_name]


def _run_gemm_case(ctx, c, epilogues, bwd_acts) -> list:
    import numpy as np

    torch = ctx.torch
    from kspec.reference import gemm as ref

    rows = []
    idx, tol = c["idx"], gemm_tolerance(c["dtype"])
    for epi in epilogues:
        act, has_bias = GEMM_EPILOGUES[epi]
        pre = c["xw64"] + (c["b64"] if has_bias else 0.0)
        want = ref.act(act, pre)
        for name, impl, role, fn, note in _gemm_fwd_variants(ctx, c, epi):
            row = _gemm_row(ctx, c, "fwd", epi, name, impl, role, note, act, has_bias)
            rows.append(row)
            if ctx.skipped(name):
                row["status"] = "skipped"
                continue
            try:
                y = fn()
                torch.cuda.synchronize()
                row["errors"]["y"] = rel_error(to_f64(y[idx]), want)
                if not bool(torch.isfinite(y).all()):
                    row["errors"]["y_finite"] = float("inf")
                del y
                row["max_error"] = max(row["errors"].values())
                row["valid"] = row["max_error"] <= tol
                row["status"] = "ok" if row["valid"] else "INVALID"
                if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                    _gemm_time(ctx, row, fn)
            except Exception as e:  # noqa: BLE001  (a failing peer is recorded, not fatal)
                row["status"] = "error"
                row["error"] = short_error(e)
                if ctx.args.verbose:
                    traceback.print_exc()
            print(f"bench: gemm {row['shape']} {c['dtype']} {epi} {name}: {row['status']}", file=sys.stderr,
                  flush=True)
    for act in bwd_acts:
        # The saved pre-activation comes from kspec's forward (x·Wᵀ + b in the dtype), and the reference
        # takes act' at those very values (a ReLU mask from the exact maths could differ in sign within
        # rounding of 0; GELU's derivative is continuous, this just keeps both sides on the same input).
        saved = ctx.kspec.ops.gemm(c["x"], c["w"], c["b"], tf32=c["tf32"])[0] if act != "none" else None
        saved64 = to_f64(saved[idx]) if saved is not None else None
        rdx, rdw, rdb = ref.gemm_bwd(to_f64(c["dy"][idx]), c["xs64"], c["w64"], saved64, act)
        epi = "bias" if act == "none" else f"bias+{act}"
        for name, impl, role, fn, note in _gemm_bwd_variants(ctx, c, act, saved):
            row = _gemm_row(ctx, c, "bwd", epi, name, impl, role, note, act, True)
            rows.append(row)
            if ctx.skipped(name):
                row["status"] = "skipped"
                continue
            try:
                out = fn(c["dy_check"])
                torch.cuda.synchronize()
                e = row["errors"]
                e["dx"] = rel_error(to_f64(out["dx"][idx]), rdx)
                if bool(c["rest"].any()):
                    rest = float(out["dx"][c["rest"]].float().norm())
                    den = max(float(np.linalg.norm(rdx)), 1e-30)
                    e["dx_rest"] = rest / den if math.isfinite(rest) else float("inf")
                e["dw"] = rel_error(to_f64(out["dw"]), rdw)
                e["db"] = rel_error(to_f64(out["db"]), rdb)
                del out
                row["max_error"] = max(e.values())
                row["valid"] = row["max_error"] <= tol
                row["status"] = "ok" if row["valid"] else "INVALID"
                if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                    _gemm_time(ctx, row, lambda fn=fn: fn(c["dy"]))
            except Exception as e:  # noqa: BLE001
                row["status"] = "error"
                row["error"] = short_error(e)
                if ctx.args.verbose:
                    traceback.print_exc()
            print(f"bench: gemm {row['shape']} {c['dtype']} bwd {epi} {name}: {row['status']}", file=sys.stderr,
                  flush=True)
        del saved
    # How many times faster kspec's raw op is than each variant, same shape, dtype, epilogue and kind.
    for r in rows:
        base = next((b for b in rows if b["impl"] == "kspec" and b["variant"].startswith("kspec gemm")
                     and b["epilogue"] == r["epilogue"] and b["kind"] == r["kind"] and "gpu_ms" in b), None)
        if base and "gpu_ms" in r:
            r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]
            r["kspec_speedup_ev"] = r["ev_ms"] / base["ev_ms"]
    return rows


def run(ctx):
    torch = ctx.torch
    ctx.kspec  # noqa: B018  (import errors surface here, before any work)
    all_epis = list(GEMM_EPILOGUES)
    if ctx.args.quick:
        plan = [((2048, 1024, 1024), "bf16", all_epis, ["none", "gelu"]), ((257, 255, 33), "bf16", all_epis, ["gelu"]),
                ((8, 1024, 1024), "bf16", ["none", "bias+gelu"], []), ((2048, 1024, 1024), "tf32", ["none"], [])]
    else:
        # (m, n, k) = (tokens, out features, in features) of a 4096-wide transformer (Llama-2-7B's MLP 11008,
        # Mistral-7B's 14336) at 16384 tokens; an odd shape (no dim a multiple of 8 or of any tile; rows of
        # 66 bytes); and one decode step (m = 8, bound by reading W).
        plan = [((16384, 4096, 4096), "bf16", all_epis, ["none", "gelu"]),
                ((16384, 11008, 4096), "bf16", all_epis, ["none", "gelu"]),
                ((16384, 14336, 4096), "bf16", all_epis, ["none", "gelu"]),
                ((16384, 4096, 11008), "bf16", all_epis, ["none", "gelu"]),
                ((4097, 4095, 33), "bf16", all_epis, ["gelu"]),
                ((8, 11008, 4096), "bf16", ["none", "bias+gelu"], []),
                ((16384, 4096, 4096), "fp16", ["none", "bias+gelu"], []),
                ((16384, 4096, 4096), "tf32", ["none"], []),
                ((16384, 4096, 4096), "fp32", ["none"], [])]
    rows = []
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for i, ((m, n, k), dt, epis, bwd) in enumerate(plan):
            torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"  # torch's peer on the same tensor cores
            c = _gemm_case(ctx, m, n, k, dt, ctx.args.seed + i)
            rows += _run_gemm_case(ctx, c, epis, bwd)
            del c
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32

    cols = [
        ("shape m×n×k", "shape"), ("dtype", "dtype"), ("epilogue", "epilogue"), ("kind", "kind"),
        ("variant", "variant"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".4f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".4f")),
        ("TFLOP/s", lambda r: fmt(r.get("tflops"), ".0f")),
        ("% peak", lambda r: fmt(r.get("pct_of_peak"), ".0f")),
        ("GB/s", lambda r: fmt(r.get("gbps"), ".0f")),
        ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
         if "kspec_speedup_gpu" in r else "—"),
        ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = [
        f"% peak: of the H100 SXM dense tensor-core peak (datasheet, no sparsity): bf16/fp16 {ctx.args.peak_tflops:g},"
        f" tf32 {H100_DENSE_TFLOPS['tf32']:g}, fp32 (CUDA cores) {H100_DENSE_TFLOPS['fp32']:g} TFLOP/s; peers.md"
        " measured 794 TFLOP/s for a bf16 torch.matmul. TFLOP/s: 2mnk (fwd), 4mnk (bwd) over the gpu time;"
        " GB/s on the minimum bytes (x, W, b read, y written once; matters at m = 8).",
        "kspec ×: this variant's time / kspec gemm's (raw op), same row group (> 1: kspec faster). Validation: the"
        f" first and last {ctx.args.check_rows // 2} rows of y (bwd: dx there, dx = 0 elsewhere, dW, db) against"
        " kspec.reference.gemm in float64 before timing; bwd pre-activation: kspec's, as the backward reads it.",
    ]
    notes += gemm_targets(rows)
    return {"results": rows, "peak_tflops": {**H100_DENSE_TFLOPS, "bf16": ctx.args.peak_tflops,
                                              "fp16": ctx.args.peak_tflops}}, \
        [Section("gemm: y = act(x·Wᵀ + b) through cuBLASLt, and gemm.bwd", cols, rows, notes)]


def gemm_targets(rows) -> list:
    """kspec against torch's same op (goal ≈ 1.0) and the fused epilogue against unfused torch (> 1)."""
    lines = [f"targets: kspec gemm TFLOP/s / torch same op ≥ {GEMM_RATIO_MIN:.2f}; fused epilogue faster than"
             " unfused torch:"]
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["dtype"], r["epilogue"], r["kind"]), []).append(r)
    for (shape, dt, epi, kind), rs in groups.items():
        ks = next((r for r in rs if r["variant"] in ("kspec gemm", "kspec gemm.bwd") and "gpu_ms" in r), None)
        if ks is None:
            lines.append(f"  {shape} {dt} {epi} {kind}: kspec not timed")
            continue
        parts = []
        same = next((r for r in rs if r["role"] == "same op" and "gpu_ms" in r), None)
        if same:
            ratio = same["gpu_ms"] / ks["gpu_ms"]
            parts.append(f"× {same['variant']} {ratio:.2f} {'ok' if ratio >= GEMM_RATIO_MIN else 'MISSED'}")
        for u in (r for r in rs if r["role"] == "unfused" and "gpu_ms" in r):
            ratio = u["gpu_ms"] / ks["gpu_ms"]
            parts.append(f"× {u['variant']} {ratio:.2f} {'ok' if ratio > 1.0 else 'MISSED'}")
        lines.append(f"  {shape} {dt} {epi} {kind}: {ks['tflops']:.0f} TFLOP/s; " + "; ".join(parts))
    return lines
