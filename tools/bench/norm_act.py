"""The norm_act benchmark: y = act(norm(x) * w + b)."""
from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from .common import TOLERANCE, Section, rel_error, short_error, to_f64
from .report import fmt

FAMILY = "norm_act"
DESCRIPTION = "y = act(norm(x)·w + b): kspec against torch eager, torch.compile and Liger"

# The targets of /work/shared/peers.md that this family judges.
NORM_ACT_FWD_MIN_PCT = 90.0
NORM_ACT_FWDBWD_MIN_PCT = 80.0
NORM_ACT_EV_OVER_GPU_MAX = 1.10


@dataclass
class NormActCase:
    rows: int
    hidden: int
    norm: str
    act: str
    has_bias: bool
    eps: float
    dtype: object
    x: object = None
    w: object = None
    b: object = None
    dy: object = None
    dy_check: object = None   # dy on the checked rows, zero elsewhere (validation call only)
    check_idx: object = None  # rows compared with the float64 reference
    rest_mask: object = None  # every other row (dx must be exactly 0 there under dy_check)

    @property
    def name(self) -> str:
        return f"{self.norm}+{self.act}" + ("+bias" if self.has_bias else "")

    @property
    def shape(self) -> str:
        return f"{self.rows}x{self.hidden}"

    def min_bytes(self, kind: str) -> int:
        # Napkin math, each tensor touched once: the forward reads x and writes y (R·H each) and
        # reads the weights (w, b: H each); the backward reads x and dy, writes dx (R·H each) and
        # reads w, b and writes dw, db. The saved statistics (8 bytes a row) are left out: a kernel
        # could recompute them. So fwd = 2·R·H·s + n_w·H·s_w and fwd+bwd = 5·R·H·s + 3·n_w·H·s_w.
        s = self.x.element_size()
        sw = self.w.element_size()
        n_w = 2 if self.has_bias else 1
        rh = self.rows * self.hidden
        fwd = 2 * rh * s + n_w * self.hidden * sw
        if kind == "fwd":
            return fwd
        return fwd + 3 * rh * s + 2 * n_w * self.hidden * sw


@dataclass
class Variant:
    name: str
    kind: str                # "fwd" or "fwd+bwd"
    impl: str                # "kspec" or "peer"
    make: Callable           # case -> (step(dy) -> outputs dict, prep())
    act: str | None = None   # what it computes, if not the case's act (Liger: norm only)
    note: str = ""


def _torch_norm_act(F, norm, act, hidden, eps):
    def norm_act(x, w, b):
        if norm == "rmsnorm":
            h = F.rms_norm(x, (hidden,), w, eps)
            if b is not None:
                h = h + b
        else:
            h = F.layer_norm(x, (hidden,), w, b, eps)
        if act == "silu":
            return F.silu(h)
        if act == "gelu_tanh":
            return F.gelu(h, approximate="tanh")
        if act == "gelu_erf":
            return F.gelu(h)
        return h

    return norm_act


def _leaves(case, torch):
    """Leaf copies that require grad (sharing storage with the case's tensors) and their reset."""
    xl = case.x.detach().requires_grad_(True)
    wl = case.w.detach().requires_grad_(True)
    bl = case.b.detach().requires_grad_(True) if case.b is not None else None

    def prep():
        for t in (xl, wl, bl):
            if t is not None:
                t.grad = None

    return xl, wl, bl, prep


def _grads(y, xl, wl, bl):
    return {"y": y, "dx": xl.grad, "dw": wl.grad, "db": bl.grad if bl is not None else None}


def norm_act_variants(ctx, case: NormActCase) -> list:
    torch = ctx.torch
    F = torch.nn.functional
    K = ctx.kspec.ops
    kw = dict(norm=case.norm, act=case.act, eps=case.eps)
    expr = _torch_norm_act(F, case.norm, case.act, case.hidden, case.eps)
    out = []

    # kspec, as users call it: the torch.library custom op (autograd through kspec's backward).
    def kspec_fwd(c):
        return (lambda dy: {"y": K.norm_act(c.x, c.w, c.b, **kw)}), None

    def kspec_raw_fwd(c):
        def step(dy):
            y, _, rstd = K.norm_act_fwd(c.x, c.w, c.b, **kw)
            return {"y": y, "rstd": rstd}

        return step, None

    def kspec_autograd(c):
        xl, wl, bl, prep = _leaves(c, torch)

        def step(dy):
            y = K.norm_act(xl, wl, bl, **kw)
            y.backward(dy)
            return _grads(y, xl, wl, bl)

        return step, prep

    def kspec_raw_fwdbwd(c):
        def step(dy):
            y, mean, rstd = K.norm_act_fwd(c.x, c.w, c.b, **kw)
            dx, dw, db = K.norm_act_bwd(dy, c.x, c.w, c.b, mean, rstd, **kw)
            return {"y": y, "dx": dx, "dw": dw, "db": db}

        return step, None

    out += [
        Variant("kspec", "fwd", "kspec", kspec_fwd, note="kspec.ops.norm_act (custom op)"),
        Variant("kspec raw op", "fwd", "kspec", kspec_raw_fwd, note="kspec.ops.norm_act_fwd"),
        Variant("kspec", "fwd+bwd", "kspec", kspec_autograd, note="autograd: y.backward(dy)"),
        Variant("kspec raw ops", "fwd+bwd", "kspec", kspec_raw_fwdbwd, note="norm_act_fwd + norm_act_bwd"),
    ]

    def eager_fwd(c):
        return (lambda dy: {"y": expr(c.x, c.w, c.b)}), None

    def eager_fwdbwd(c):
        xl, wl, bl, prep = _leaves(c, torch)

        def step(dy):
            y = expr(xl, wl, bl)
            y.backward(dy)
            return _grads(y, xl, wl, bl)

        return step, prep

    def compiled_fwd(c):
        f = torch.compile(_torch_norm_act(F, c.norm, c.act, c.hidden, c.eps), dynamic=False)
        return (lambda dy: {"y": f(c.x, c.w, c.b)}), None

    def compiled_fwdbwd(c):
        f = torch.compile(_torch_norm_act(F, c.norm, c.act, c.hidden, c.eps), dynamic=False)
        xl, wl, bl, prep = _leaves(c, torch)

        def step(dy):
            y = f(xl, wl, bl)
            y.backward(dy)
            return _grads(y, xl, wl, bl)

        return step, prep

    act_text = {"silu": "F.silu", "gelu_tanh": "F.gelu(tanh)", "gelu_erf": "F.gelu", "identity": ""}[case.act]
    norm_text = "F.rms_norm" + (" + b" if case.has_bias else "") if case.norm == "rmsnorm" else "F.layer_norm"
    eager_note = norm_text + (f" → {act_text}" if act_text else "")
    out += [
        Variant("torch eager", "fwd", "peer", eager_fwd, note=eager_note),
        Variant("torch eager", "fwd+bwd", "peer", eager_fwdbwd, note=eager_note),
        Variant("torch.compile", "fwd", "peer", compiled_fwd, note="torch.compile(same, dynamic=False)"),
        Variant("torch.compile", "fwd+bwd", "peer", compiled_fwdbwd, note="torch.compile(same, dynamic=False)"),
    ]

    # Liger: norm only (no activation), the fastest norm users have; its RMSNorm has no bias.
    if case.norm == "layernorm" or not case.has_bias:
        def liger_module(c, grad):
            if c.norm == "rmsnorm":
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                # in_place=False: the default overwrites dy with dx in the backward.
                m = LigerRMSNorm(c.hidden, eps=c.eps, in_place=False)
            else:
                from liger_kernel.transformers.layer_norm import LigerLayerNorm

                m = LigerLayerNorm(c.hidden, eps=c.eps, bias=True)
            m = m.to(device=c.x.device, dtype=c.dtype)
            with torch.no_grad():
                m.weight.copy_(c.w)
                if c.norm == "layernorm":
                    if c.b is not None:
                        m.bias.copy_(c.b)
                    else:
                        m.bias.zero_()
            m.requires_grad_(grad)
            return m

        def liger_fwd(c):
            m = liger_module(c, False)
            return (lambda dy: {"y": m(c.x)}), None

        def liger_fwdbwd(c):
            m = liger_module(c, True)
            xl = c.x.detach().requires_grad_(True)

            def prep():
                xl.grad = None
                m.zero_grad(set_to_none=True)

            def step(dy):
                y = m(xl)
                y.backward(dy)
                bias = getattr(m, "bias", None)
                return {"y": y, "dx": xl.grad, "dw": m.weight.grad,
                        "db": bias.grad if (c.has_bias and bias is not None) else None}

            return step, prep

        liger_name = "LigerRMSNorm" if case.norm == "rmsnorm" else "LigerLayerNorm"
        out += [
            Variant("liger (norm only)", "fwd", "peer", liger_fwd, act="identity", note=liger_name),
            Variant("liger (norm only)", "fwd+bwd", "peer", liger_fwdbwd, act="identity", note=liger_name),
        ]
    return out


def make_norm_act_case(ctx, rows, hidden, norm, act, has_bias) -> NormActCase:
    torch = ctx.torch
    dev = ctx.dev
    dtype = torch.bfloat16
    g = torch.Generator(device=dev)
    g.manual_seed(ctx.args.seed + rows * 31 + hidden)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale + shift).to(dtype)

    c = NormActCase(rows, hidden, norm, act, has_bias, 1e-5, dtype)
    c.x = randn(rows, hidden)
    c.w = randn(hidden, scale=0.1, shift=1.0)
    c.b = randn(hidden, scale=0.1) if has_bias else None
    c.dy = randn(rows, hidden)
    # The reference is NumPy float64: checking every row of a 16384x4096 problem takes seconds per
    # variant, so the first and last check_rows/2 rows are compared (the first and last blocks
    # catch indexing and tail bugs). For the weight gradients, which sum over every row, the
    # validation call gets a dy that is zero outside those rows: dw and db then equal the
    # reference's over the checked rows, and dx must be exactly zero on every other row.
    k = min(ctx.args.check_rows, rows)
    idx = list(range(rows)) if k >= rows else list(range(k // 2)) + list(range(rows - (k - k // 2), rows))
    c.check_idx = torch.tensor(idx, device=dev, dtype=torch.long)
    c.rest_mask = torch.ones(rows, dtype=torch.bool, device=dev)
    c.rest_mask[c.check_idx] = False
    c.dy_check = torch.zeros_like(c.dy)
    c.dy_check[c.check_idx] = c.dy[c.check_idx]
    return c


def norm_act_reference(case: NormActCase, act: str) -> dict:
    from kspec.reference import norm_act as ref

    xs = to_f64(case.x[case.check_idx])
    dys = to_f64(case.dy[case.check_idx])
    w = to_f64(case.w)
    b = to_f64(case.b) if case.b is not None else None
    y, _, rstd = ref.norm_act_fwd(xs, w, b, case.norm, act, case.eps)
    dx, dw, db = ref.norm_act_bwd(dys, xs, w, b, case.norm, act, case.eps)
    return {"y": y, "rstd": rstd, "dx": dx, "dw": dw, "db": db}


def validate_norm_act(torch, case: NormActCase, kind: str, out: dict, ref: dict) -> dict:
    import numpy as np

    errs = {}
    y = out["y"]
    errs["y"] = rel_error(to_f64(y[case.check_idx]), ref["y"])
    if not bool(torch.isfinite(y).all()):
        errs["y_finite"] = float("inf")
    if out.get("rstd") is not None:
        errs["rstd"] = rel_error(to_f64(out["rstd"].reshape(-1)[case.check_idx]), ref["rstd"])
    if kind == "fwd+bwd":
        dx = out["dx"]
        if dx is None or out.get("dw") is None:
            return {**errs, "grads_missing": float("inf")}
        errs["dx"] = rel_error(to_f64(dx[case.check_idx]), ref["dx"])
        if bool(case.rest_mask.any()):
            rest = float(dx[case.rest_mask].float().norm())
            errs["dx_rest"] = rest / max(float(np.linalg.norm(ref["dx"])), 1e-30)
            if math.isnan(errs["dx_rest"]):
                errs["dx_rest"] = float("inf")
        errs["dw"] = rel_error(to_f64(out["dw"]), ref["dw"])
        if case.has_bias:
            errs["db"] = rel_error(to_f64(out["db"]), ref["db"]) if out.get("db") is not None else float("inf")
    return errs


def run_norm_act_variant(ctx, case: NormActCase, v: Variant, refs: dict, ceiling_tbps: float) -> dict:
    torch = ctx.torch
    tol = TOLERANCE[str(case.dtype).replace("torch.", "")]
    row = {"family": "norm_act", "shape": case.shape, "rows": case.rows, "hidden": case.hidden,
           "dtype": str(case.dtype).replace("torch.", ""), "norm": case.norm, "act": case.act,
           "bias": case.has_bias, "op": case.name, "variant": v.name, "kind": v.kind, "impl": v.impl,
           "computes": f"{case.norm}+{v.act or case.act}", "note": v.note, "bytes": case.min_bytes(v.kind),
           "tolerance": tol, "status": "", "errors": {}}
    if ctx.skipped(v.name):
        row["status"] = "skipped"
        return row
    try:
        step, prep = v.make(case)
        prep = prep or (lambda: None)
        act = v.act or case.act
        if act not in refs:
            refs[act] = norm_act_reference(case, act)
        prep()
        out = step(case.dy_check)
        torch.cuda.synchronize()
        row["errors"] = validate_norm_act(torch, case, v.kind, out, refs[act])
        del out
        row["max_error"] = max(row["errors"].values())
        row["valid"] = row["max_error"] <= tol
        if not row["valid"]:
            # A failing kspec kernel's time means nothing; a failing peer's is still what its users get.
            row["status"] = "INVALID"
            if v.impl == "kspec" and not ctx.args.time_invalid:
                return row
        t = ctx.timer.time(lambda: step(case.dy), prep)
        row.update(t)
        row["gbps"] = row["bytes"] / (t["gpu_ms"] * 1e6)
        row["pct_of_peak"] = 100.0 * row["bytes"] / (t["gpu_ms"] * 1e-3) / (ctx.args.peak_tbps * 1e12)
        row["pct_of_copy"] = 100.0 * row["bytes"] / (t["gpu_ms"] * 1e-3) / (ceiling_tbps * 1e12) \
            if ceiling_tbps else None
        row["status"] = row["status"] or "ok"
    except Exception as e:  # a peer that fails (torch.compile, Liger missing) is recorded, not fatal
        row["status"] = "error"
        row["error"] = short_error(e)
        if ctx.args.verbose:
            traceback.print_exc()
    return row


def run(ctx):
    torch = ctx.torch
    ceiling = ctx.copy_ceiling()
    # 2048x32768: rows past the 8192 register limit, streamed.
    shapes = [(2048, 1024), (1024, 4096)] if ctx.args.quick else [(16384, 4096), (4096, 8192), (2048, 32768)]
    configs = [("rmsnorm", "silu", False), ("layernorm", "gelu_tanh", True)]
    rows = []
    for r, h in shapes:
        for norm, act, has_bias in configs:
            case = make_norm_act_case(ctx, r, h, norm, act, has_bias)
            refs: dict = {}
            case_rows = []
            for v in norm_act_variants(ctx, case):
                t0 = time.perf_counter()
                row = run_norm_act_variant(ctx, case, v, refs, ceiling["copy_tbps"])
                row["seconds"] = time.perf_counter() - t0
                case_rows.append(row)
                print(f"bench: norm_act {case.shape} {case.name} {v.name} {v.kind}: {row['status']}"
                      f" ({row['seconds']:.1f} s)", file=sys.stderr, flush=True)
            for kind in ("fwd", "fwd+bwd"):
                base = next((x for x in case_rows if x["variant"] == "kspec" and x["kind"] == kind), None)
                for x in case_rows:
                    if x["kind"] != kind or base is None or "gpu_ms" not in base or "gpu_ms" not in x:
                        continue
                    # How many times faster kspec's call is than this variant's (> 1: kspec faster).
                    x["kspec_speedup_gpu"] = x["gpu_ms"] / base["gpu_ms"]
                    x["kspec_speedup_ev"] = x["ev_ms"] / base["ev_ms"]
            rows += case_rows
            del case, refs
            torch.cuda.empty_cache()

    peak = ctx.args.peak_tbps
    cols = [
        ("shape", "shape"), ("op (bf16)", "op"), ("variant", "variant"), ("kind", "kind"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".4f")),
        ("ev ms", lambda r: fmt(r.get("ev_ms"), ".4f")),
        ("host µs", lambda r: fmt(r.get("host_us"), ".0f")),
        ("GB/s", lambda r: fmt(r.get("gbps"), ".0f")),
        (f"% of {peak:g} TB/s", lambda r: fmt(r.get("pct_of_peak"), ".0f")),
        ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
         if "kspec_speedup_gpu" in r else "—"),
        ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = [
        f"device-to-device copy: {ceiling['copy_tbps']:.2f} TB/s (read+write, {ceiling['bytes'] >> 20} MiB moved;"
        f" ev {ceiling['copy_ev_tbps']:.2f} TB/s) — peers.md measured 3.02 TB/s",
        "gpu: spin queued before the start event (pure GPU time); ev: plain events (includes host launch time);"
        " host µs: host time to enqueue one call; GB/s and % on the minimum bytes, from the gpu time;"
        " kspec ×: this variant's time / kspec's (custom-op) time, same kind (> 1: kspec faster);"
        " liger is norm only (no activation).",
    ]
    notes += norm_act_targets(rows, ctx.args.quick)
    data = {"copy_ceiling": ceiling, "results": rows}
    return data, [Section("norm_act: y = act(norm(x)·w + b), bf16", cols, rows, notes)]


def norm_act_targets(rows, quick) -> list:
    """peers.md's targets for kspec's own call, judged on this run."""
    lines = ["targets (peers.md)" + (" — --quick shapes, indicative only" if quick else "") + ":"]
    for r in rows:
        if r["variant"] != "kspec" or "gpu_ms" not in r:
            continue
        if r["kind"] == "fwd":
            ok = r["pct_of_peak"] >= NORM_ACT_FWD_MIN_PCT
            lines.append(f"  fwd {r['shape']} {r['op']}: {r['gpu_ms']:.4f} ms, {r['pct_of_peak']:.0f}% "
                         f"(≥ {NORM_ACT_FWD_MIN_PCT:.0f}%) {'ok' if ok else 'MISSED'}")
        else:
            ok_pct = r["pct_of_peak"] >= NORM_ACT_FWDBWD_MIN_PCT
            ratio = r["ev_ms"] / r["gpu_ms"]
            ok_ev = ratio <= NORM_ACT_EV_OVER_GPU_MAX
            lines.append(f"  fwd+bwd {r['shape']} {r['op']}: {r['gpu_ms']:.4f} ms gpu, {r['pct_of_peak']:.0f}% "
                         f"(≥ {NORM_ACT_FWDBWD_MIN_PCT:.0f}%) {'ok' if ok_pct else 'MISSED'}; ev/gpu {ratio:.2f} "
                         f"(≤ {NORM_ACT_EV_OVER_GPU_MAX:.2f}) {'ok' if ok_ev else 'MISSED'}")
    return lines
