#!/usr/bin/env python3
"""kspec benchmarks: one runner, a routine per op family, the peers in the same process.

    python3 tools/bench/bench.py                       # every family (norm_act, selective_scan, gemm, adamw, jit)
    python3 tools/bench/bench.py --family gemm --family adamw --json /tmp/bench.json
    python3 tools/bench/bench.py --family norm_act --quick --json /tmp/bench.json
    python3 tools/bench/bench.py --family jit --dispatch-bin build/tools/bench/kspec_dispatch_bench

Method (the one of /work/shared/peers.md, so figures compare): random inputs, never zeros; every
variant checked against the float64 reference before it is timed; CUDA events around one call, a
256 MiB write between calls to flush L2, the median over >= 30 calls after warm-up; two times per
call: gpu (a GPU spin queued before the start event, so the whole call is queued before the clock
starts) and ev (plain events after a synchronize, so host launch time shows when the host is slower
than the GPU). A family is one function registered with @family; see README.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

# Relative error ‖out − ref‖ / ‖ref‖ allowed against the float64 reference, by dtype.
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}

# The targets of /work/shared/peers.md that this runner can judge.
NORM_ACT_FWD_MIN_PCT = 90.0
NORM_ACT_FWDBWD_MIN_PCT = 80.0
NORM_ACT_EV_OVER_GPU_MAX = 1.10
JIT_PY_CALL_MAX_US = 5.0
JIT_CPP_OVER_RAW_MAX_US = 0.5
JIT_COLD_COMPILE_MAX_MS = 1000.0
JIT_DISK_HIT_MAX_MS = 2.0


def _median(v):
    return statistics.median(v) if v else float("nan")


def _p90(v):
    s = sorted(v)
    return s[min(len(s) - 1, int(0.9 * len(s)))] if s else float("nan")


def _short_error(e: BaseException, limit: int = 2000) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " …"


def _brief(text: str, limit: int = 160) -> str:
    """The last non-empty line of an error: where a subprocess's stderr ends, the reason usually is."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= limit else last[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# Timing


class GpuTimer:
    """CUDA-event timing of one call at a time, L2 flushed before each call."""

    def __init__(self, torch, device: str, reps: int, warmup: int, flush_bytes: int = 256 << 20):
        self.torch = torch
        self.reps = reps
        self.warmup = warmup
        self.flush_buf = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.has_sleep = hasattr(torch.cuda, "_sleep")
        self.cycles_per_us = self._calibrate_sleep() if self.has_sleep else 0.0

    def _calibrate_sleep(self) -> float:
        torch = self.torch
        cycles = 1_000_000
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        ms = []
        for _ in range(5):
            self.start.record()
            torch.cuda._sleep(cycles)
            self.end.record()
            self.end.synchronize()
            ms.append(self.start.elapsed_time(self.end))
        return cycles / max(_median(ms) * 1e3, 1e-3)

    def flush(self):
        self.flush_buf.zero_()

    def _gpu_pass(self, fn, prep, sleep_us):
        torch = self.torch
        cycles = int(sleep_us * self.cycles_per_us)
        times, host, late = [], [], 0
        for _ in range(self.reps):
            prep()
            self.flush()
            t0 = time.perf_counter()
            if cycles:
                torch.cuda._sleep(cycles)
            self.start.record()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            self.end.record()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            times.append(self.start.elapsed_time(self.end))
            host.append((t2 - t1) * 1e6)
            late += (t3 - t0) * 1e6 > sleep_us
        return times, host, late

    def time(self, fn: Callable[[], object], prep: Callable[[], object] | None = None) -> dict:
        """Median gpu and ev times of fn() in ms, with min/p90, host enqueue time and the spin used."""
        torch = self.torch
        prep = prep or (lambda: None)
        warm = []
        for _ in range(self.warmup):
            prep()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            warm.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        # The spin must outlast the host's enqueueing of the whole call, or the gpu time would
        # include host gaps; a host-bound call (autograd, torch.compile guards) needs a longer one.
        sleep_us = min(max(100.0, 2.0 * _median(warm) + 50.0), 50_000.0) if self.has_sleep else 0.0
        for _ in range(3):
            gpu, host, late = self._gpu_pass(fn, prep, sleep_us)
            if not self.has_sleep or late <= self.reps // 10 or sleep_us >= 50_000.0:
                break
            sleep_us = min(sleep_us * 4, 50_000.0)
        ev = []
        for _ in range(self.reps):
            prep()
            self.flush()
            torch.cuda.synchronize()
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            ev.append(self.start.elapsed_time(self.end))
        return {
            "gpu_ms": _median(gpu), "gpu_min_ms": min(gpu), "gpu_p90_ms": _p90(gpu),
            "ev_ms": _median(ev), "ev_min_ms": min(ev), "ev_p90_ms": _p90(ev),
            "host_us": _median(host), "sleep_us": sleep_us, "not_fully_queued": late if self.has_sleep else None,
            "reps": self.reps,
        }


def host_per_call_us(fn, sync, calls: int, repeats: int = 5) -> dict:
    """Host wall clock of `calls` back-to-back calls, divided by `calls` (median of `repeats`)."""
    for _ in range(min(calls, 200)):
        fn()
    sync()
    per_call, with_sync = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        per_call.append((t1 - t0) / calls * 1e6)
        with_sync.append((t2 - t0) / calls * 1e6)
    return {"us": _median(per_call), "min_us": min(per_call), "us_incl_sync": _median(with_sync),
            "calls": calls, "repeats": repeats}


# ---------------------------------------------------------------------------------------------
# Validation


def rel_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (absolute ‖out‖ when ref is all zeros)."""
    import numpy as np

    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return float("inf")
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(out - ref))
    if math.isnan(num):
        return float("inf")
    return num / den if den > 0 else num


def to_f64(t):
    return t.detach().double().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# The runner: families, context, tables


class NoGpu(RuntimeError):
    """No CUDA device (or no torch): the families say so and the run exits with status 2."""


@dataclass
class Section:
    """One table of a family's output; `rows` are dicts, `columns` (header, key or formatter)."""

    title: str
    columns: list
    rows: list
    notes: list = field(default_factory=list)


FAMILIES: dict[str, Callable] = {}


def family(name: str):
    """Registers a benchmark routine: fn(ctx) -> (json-able dict, [Section])."""

    def deco(fn):
        FAMILIES[name] = fn
        return fn

    return deco


class Context:
    """What every family shares: arguments, lazily imported torch and kspec, one timer, one copy ceiling."""

    def __init__(self, args):
        self.args = args
        self.dev = f"cuda:{args.device}"
        self._timer = None
        self._ceiling = None

    @property
    def torch(self):
        try:
            import torch
        except ImportError as e:
            raise NoGpu(f"torch is not importable ({e})") from None
        if not torch.cuda.is_available():
            raise NoGpu("torch sees no CUDA device")
        torch.cuda.set_device(self.args.device)
        return torch

    @property
    def kspec(self):
        import kspec

        return kspec

    @property
    def timer(self) -> GpuTimer:
        if self._timer is None:
            self._timer = GpuTimer(self.torch, self.dev, self.args.reps, self.args.warmup)
        return self._timer

    def skipped(self, variant: str) -> bool:
        return any(s.lower() in variant.lower() for s in self.args.skip or [])

    def copy_ceiling(self) -> dict:
        """Device-to-device copy rate, measured like everything else (bytes = read + write)."""
        if self._ceiling is None:
            torch = self.torch
            dev = self.dev
            n = (256 << 20) if self.args.quick else (1 << 30)
            src = torch.randint(1, 255, (n,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            dst.copy_(src)
            if not torch.equal(dst, src):
                raise RuntimeError("device-to-device copy gave wrong bytes")
            t = self.timer.time(lambda: dst.copy_(src))
            self._ceiling = {"bytes": 2 * n, "copy_tbps": 2 * n / (t["gpu_ms"] * 1e-3) / 1e12,
                             "copy_ev_tbps": 2 * n / (t["ev_ms"] * 1e-3) / 1e12, **t}
            del src, dst
        return self._ceiling


def _fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec)


def print_section(sec: Section):
    header = [c[0] for c in sec.columns]
    cells = []
    for r in sec.rows:
        line = []
        for _, key in sec.columns:
            v = key(r) if callable(key) else r.get(key)
            line.append("—" if v is None else str(v))
        cells.append(line)
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=sec.title, title_justify="left")
        for h in header:
            t.add_column(h, overflow="fold")
        for line in cells:
            t.add_row(*line)
        console = Console(width=max(200, shutil.get_terminal_size((200, 50)).columns))
        console.print(t)
        for n in sec.notes:
            console.print(n, markup=False, highlight=False)
    except ImportError:
        print(sec.title)
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for line in cells:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
        for n in sec.notes:
            print(n)
    print()


# ---------------------------------------------------------------------------------------------
# norm_act: y = act(norm(x) * w + b)


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
        row["error"] = _short_error(e)
        if ctx.args.verbose:
            traceback.print_exc()
    return row


@family("norm_act")
def bench_norm_act(ctx):
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
        ("gpu ms", lambda r: _fmt(r.get("gpu_ms"), ".4f")),
        ("ev ms", lambda r: _fmt(r.get("ev_ms"), ".4f")),
        ("host µs", lambda r: _fmt(r.get("host_us"), ".0f")),
        ("GB/s", lambda r: _fmt(r.get("gbps"), ".0f")),
        (f"% of {peak:g} TB/s", lambda r: _fmt(r.get("pct_of_peak"), ".0f")),
        ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
         if "kspec_speedup_gpu" in r else "—"),
        ("max rel err", lambda r: _fmt(r.get("max_error"), ".1e")),
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


# ---------------------------------------------------------------------------------------------
# jit: compile and disk-hit times, host overhead per call


# ---------------------------------------------------------------------------------------------
# selective_scan: the Mamba S6 scan, bf16, variable B/C (one group), D, z, delta_bias, softplus, dstate 16

# Floors. Bytes: u, delta, z read and out written once (B, C: 2 * batch * dstate * seqlen more), fwd+bwd
# adds dout, du, ddelta, dz and the forward's reads again. Exponentials: one ex2 per (b, d, t, n) in the
# forward, three in fwd+bwd (the forward, the backward's recompute and its adjoint: kspec's with the
# forward's states every 16 steps, four with segments; without them its backward does three itself, five
# with segments; mamba_ssm's forward saves x and its backward does one); the SFU does 16 ex2 per SM and
# clock: 16 * 132 * 1.755e9 = 3.71e12 per second on the H100.
_SFU_EX2_PER_S = 16 * 132 * 1.755e9


def _scan_inputs(torch, dev, b, d, t, n, seed):
    g = torch.Generator(device=dev).manual_seed(seed)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    return dict(u=rn(b, d, t), delta=rn(b, d, t) * 0.5 - 1.0, A=-(0.25 + rn(d, n, dtype=torch.float32).abs()),
                B=rn(b, 1, n, t), C=rn(b, 1, n, t), D=rn(d, dtype=torch.float32), z=rn(b, d, t),
                delta_bias=rn(d, dtype=torch.float32) * 0.1)


def _scan_check(torch, x, out, channels=4, steps=512):
    """out[0, :channels, :steps] against the float64 reference (its prefix needs only those steps)."""
    from kspec.reference import selective_scan as ref

    sl = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    c, s = channels, steps
    yr, _ = ref.selective_scan_fwd(sl(x["u"][:1, :c, :s]), sl(x["delta"][:1, :c, :s]), sl(x["A"][:c]),
                                   sl(x["B"][:1, :, :, :s]), sl(x["C"][:1, :, :, :s]), sl(x["D"][:c]),
                                   sl(x["z"][:1, :c, :s]), sl(x["delta_bias"][:c]), True)
    return rel_error(out[:1, :c, :s], torch.from_numpy(yr))


@family("selective_scan")
def bench_selective_scan(ctx):
    torch = ctx.torch
    kspec = ctx.kspec
    shapes = [(2, 1024, 1024)] if ctx.args.quick else [(8, 2048, 2048), (8, 5120, 2048), (8, 2048, 8192),
                                                      (1, 2048, 65536)]
    if ctx.args.scan_shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in ctx.args.scan_shapes.split(",")]
    peer = None
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as peer  # torch imported first
    except Exception as e:  # noqa: BLE001
        print(f"bench: selective_scan: mamba_ssm not importable ({_brief(str(e))})", file=sys.stderr)
    n = 16
    rows = []
    for b, d, t in shapes:
        x = _scan_inputs(torch, ctx.dev, b, d, t, n, ctx.args.seed)
        leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
        dout = torch.randn_like(x["u"])
        impls = [("kspec", kspec.ops.selective_scan_fn)] + ([("mamba_ssm", peer)] if peer else [])
        for impl, fn in impls:
            def fwd(fn=fn, a=x):
                return fn(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"], True)

            def fwdbwd(fn=fn):
                for v in leaves.values():
                    v.grad = None
                y = fn(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"], leaves["D"],
                       leaves["z"], leaves["delta_bias"], True)
                y.backward(dout)

            elems = b * d * t
            for kind, step, nbytes, ex2 in (("fwd", fwd, 2 * 4 * elems + 2 * 2 * b * n * t, elems * n),
                                            ("fwd+bwd", fwdbwd, 2 * 11 * elems + 2 * 6 * b * n * t, 3 * elems * n)):
                row = {"family": "selective_scan", "shape": f"{b}x{d}x{t}", "impl": impl, "kind": kind,
                       "bytes": nbytes, "status": ""}
                if ctx.skipped(impl):
                    row["status"] = "skipped"
                    rows.append(row)
                    continue
                try:
                    row["max_error"] = _scan_check(torch, x, fwd().float().cpu())
                    row["valid"] = row["max_error"] <= 2e-2
                    row["status"] = "ok" if row["valid"] else "INVALID"
                    if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                        row.update(ctx.timer.time(step))
                        row["bytes_floor_ms"] = nbytes / (ctx.args.peak_tbps * 1e12) * 1e3
                        row["ex2_floor_ms"] = ex2 / _SFU_EX2_PER_S * 1e3
                except Exception as e:  # noqa: BLE001
                    row["status"] = "error"
                    row["error"] = _short_error(e)
                    if ctx.args.verbose:
                        traceback.print_exc()
                rows.append(row)
                print(f"bench: selective_scan {row['shape']} {impl} {kind}: {row['status']}", file=sys.stderr,
                      flush=True)
        del x, leaves, dout
        torch.cuda.empty_cache()
    for r in rows:
        base = next((k for k in rows if k["impl"] == "kspec" and k["kind"] == r["kind"] and k["shape"] == r["shape"]
                     and "gpu_ms" in k), None)
        if base and "gpu_ms" in r:
            r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]
    cols = [
        ("shape (B×D×L)", "shape"), ("impl", "impl"), ("kind", "kind"),
        ("gpu ms", lambda r: _fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: _fmt(r.get("ev_ms"), ".3f")),
        ("bytes floor ms", lambda r: _fmt(r.get("bytes_floor_ms"), ".3f")),
        ("ex2 floor ms", lambda r: _fmt(r.get("ex2_floor_ms"), ".3f")),
        ("kspec × (gpu)", lambda r: _fmt(r.get("kspec_speedup_gpu"), ".2f")),
        ("rel err (prefix)", lambda r: _fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = ["targets (H100, peers.md): fwd <= 0.30 ms and fwd+bwd <= 1.5 ms at 8x2048x2048; >= 2x mamba_ssm"
             " (1.45/7.46, 2.75/12.3, 3.00/14.3 ms at the other shapes).",
             "validation: out[0, :4, :512] against the float64 reference before timing. Not benchmarked: a"
             " torch.compile of the reference (a Python loop over seqlen steps does not compile in useful time)."]
    return {"results": rows}, [Section("selective_scan: bf16, variable B/C, D, z, delta_bias, softplus, dstate 16",
                                       cols, rows, notes)]


@family("selective_scan_configs")
def bench_selective_scan_configs(ctx):
    """selective_scan.fwd or .bwd (--scan-op) at one shape (--scan-shape BxDxL, default 8x2048x2048) under
    each config of a list (--scan-config, repeatable; default: a forward sweep), the heuristic's choice
    timed too and marked: which algorithm, block shape and segment count to prefer. Raw kspec.call, no
    autograd: the forward without states (inference), the backward with the forward's states (training;
    --scan-own-states: without, so it makes its own). Each config's outputs are compared with the
    heuristic's before it is timed (the forward's out prefix also with the float64 reference)."""
    torch = ctx.torch
    kspec = ctx.kspec
    op = f"selective_scan.{ctx.args.scan_op}"
    b, d, t = (2, 1024, 1024) if ctx.args.quick else tuple(int(v) for v in ctx.args.scan_shape.split("x"))
    n = 16
    x = _scan_inputs(torch, ctx.dev, b, d, t, n, ctx.args.seed)
    fwd_args = (x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], None)
    states = None
    if ctx.args.scan_op == "bwd" and not ctx.args.scan_own_states:
        states = torch.empty(b, d, -(-t // 16), n, device=ctx.dev)
        kspec.call("selective_scan.fwd", *fwd_args, delta_softplus=True,
                   out=(torch.empty_like(x["u"]), torch.empty(b, d, n, device=ctx.dev), states))
    args = fwd_args if ctx.args.scan_op == "fwd" else (torch.randn_like(x["u"]),) + fwd_args + (None, states)
    configs = list(ctx.args.scan_config or [])
    if not configs:
        configs = ["algo=warp,warps=4,items=8,lanes=1,chunk=32,segs=1", "algo=warp,warps=2,items=8,lanes=1,chunk=32,segs=1"]
        for warps in (2, 4, 8):
            for lanes in (1, 2, 4):
                for chunk in (32, 64, 128):
                    configs.append(f"algo=sequential,warps={warps},items=4,lanes={lanes},chunk={chunk},segs=1")
    try:  # the heuristic's config, as explain() prints it
        m = re.search(r"algo=[0-9a-z=,]+", str(kspec.explain(op, *args, delta_softplus=True)))
        heur = m.group(0) if m else ""
    except Exception:  # noqa: BLE001
        heur = ""
    if heur and heur not in configs:
        configs.insert(0, heur)
    ref_out = [o.float() for o in kspec.call(op, *args, delta_softplus=True) if o is not None]
    rows = []
    elems = b * d * t
    for cfg in configs:
        row = {"family": "selective_scan_configs", "op": op, "shape": f"{b}x{d}x{t}", "config": cfg,
               "heuristic": cfg == heur, "status": ""}
        try:
            step = lambda cfg=cfg: kspec.call(op, *args, config=cfg, delta_softplus=True)  # noqa: E731
            outs = [o.float() for o in step() if o is not None]
            row["vs_heuristic"] = max(float((o - r).norm() / r.norm().clamp_min(1e-30)) for o, r in zip(outs, ref_out))
            ok = row["vs_heuristic"] <= 1e-2
            if ctx.args.scan_op == "fwd":
                row["max_error"] = _scan_check(torch, x, outs[0][:1, :4, :512].cpu())
                ok = ok and row["max_error"] <= 2e-2
            row["status"] = "ok" if ok else "INVALID"
            if ok:
                row.update(ctx.timer.time(step))
                row["ex2_floor_ms"] = elems * n * (1 if ctx.args.scan_op == "fwd" else 2) / _SFU_EX2_PER_S * 1e3
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["error"] = _short_error(e)
        rows.append(row)
        print(f"bench: selective_scan_configs {op} {cfg}: {row['status']} {row.get('gpu_ms', '')}", file=sys.stderr,
              flush=True)
    cols = [("config", "config"), ("heuristic", lambda r: "*" if r["heuristic"] else ""),
            ("gpu ms", lambda r: _fmt(r.get("gpu_ms"), ".4f")), ("ev ms", lambda r: _fmt(r.get("ev_ms"), ".4f")),
            ("ex2 floor ms", lambda r: _fmt(r.get("ex2_floor_ms"), ".3f")),
            ("vs heuristic", lambda r: _fmt(r.get("vs_heuristic"), ".1e")),
            ("rel err (prefix)", lambda r: _fmt(r.get("max_error"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    notes = ["ex2 floor: one ex2 per step and state for the forward, two for the backward (its recompute from"
             " the forward's states and the adjoint; three without the states, and one more with segments)."]
    return {"results": rows}, [Section(f"{op} configs, bf16, {b}x{d}x{t}, dstate {n}", cols, rows, notes)]


# ---------------------------------------------------------------------------------------------
# gemm: y = act(x·Wᵀ + b) through cuBLASLt (kspec.ops.gemm / linear) and its backward (gemm.bwd)

# The % column is of the H100 SXM's dense tensor-core peak from NVIDIA's datasheet (no sparsity), in
# TFLOP/s: bf16 and fp16 989.4, tf32 494.7; fp32 without TF32 runs on the CUDA cores, 66.9. peers.md
# measured 794 TFLOP/s for a bf16 torch.matmul; the torch rows of the same run show what is reachable.
H100_DENSE_TFLOPS = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
# TF32 rounds the inputs to 10 mantissa bits: ~1e-3 relative error at k = 4096 (tests use 3e-3).
GEMM_TOLERANCE = {"bf16": TOLERANCE["bfloat16"], "fp16": TOLERANCE["float16"], "fp32": TOLERANCE["float32"],
                  "tf32": 3e-3}
GEMM_RATIO_MIN = 0.95  # kspec's TFLOP/s over torch's for the same op: the goal is ≈ 1.0
GEMM_EPILOGUES = {"none": ("none", False), "bias": ("none", True), "bias+relu": ("relu", True),
                  "bias+gelu": ("gelu", True)}


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
            "tolerance": GEMM_TOLERANCE[c["dtype"]], "status": "", "errors": {}}


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
    idx, tol = c["idx"], GEMM_TOLERANCE[c["dtype"]]
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
                row["error"] = _short_error(e)
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
                row["error"] = _short_error(e)
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


@family("gemm")
def bench_gemm(ctx):
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
        ("gpu ms", lambda r: _fmt(r.get("gpu_ms"), ".4f")), ("ev ms", lambda r: _fmt(r.get("ev_ms"), ".4f")),
        ("TFLOP/s", lambda r: _fmt(r.get("tflops"), ".0f")),
        ("% peak", lambda r: _fmt(r.get("pct_of_peak"), ".0f")),
        ("GB/s", lambda r: _fmt(r.get("gbps"), ".0f")),
        ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
         if "kspec_speedup_gpu" in r else "—"),
        ("max rel err", lambda r: _fmt(r.get("max_error"), ".1e")),
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


# ---------------------------------------------------------------------------------------------
# linear_sweep: kspec.ops.linear's untuned default against torch's F.linear (+ a separate activation)

LINEAR_RATIO_MIN = 1 / 1.1  # issue 33: the default within 1.1x of torch for every act (torch ms / kspec ms)


def linear_sweep_shapes(quick: bool) -> list:
    """(m, n, k) = (tokens, out features, in features): small K (7, 33, 64), small M (1, 32), odd N (4095,
    4097), the issue's shapes, and LLM layers (4096-wide, Llama-2-7B's MLP 11008)."""
    if quick:
        return [(33, 4097, 7), (4097, 4095, 33), (32, 4096, 4096), (2048, 2048, 2048)]
    return [(33, 4097, 7), (4097, 4095, 7), (4097, 4095, 33), (4097, 4095, 64), (16384, 4096, 33),
            (16384, 4096, 64), (1, 4096, 4096), (32, 4096, 4096), (1, 11008, 4096), (32, 4097, 4096),
            (4096, 4097, 4096), (4096, 4095, 1024), (4096, 4096, 4096), (16384, 4096, 4096),
            (16384, 11008, 4096)]


def linear_path(kspec, x, w, b, act) -> str:
    """Which path kspec.ops.linear's gemm takes: 'fused' (cuBLASLt's epilogue), 'unfused=1|2' (the plain
    GEMM, then kspec's bias/act kernel), '+C bias' (relu in 16-bit: the bias summed in fp32 as C), and
    where the config came from (heuristic or tuned)."""
    e = kspec.explain("gemm", x, w, b, act=act)
    path = e.config if e.config.startswith("unfused") else "fused"
    if any("gemm_fill_bias" in k["name"] for k in e.kernels):
        path += " +C bias"
    return f"{path} ({e.config_source})"


@family("linear_sweep")
def bench_linear_sweep(ctx):
    """kspec.ops.linear's default (run with KSPEC_TUNE=off for the untuned heuristic; the path column says
    which config ran and where it came from) against F.linear + act, bf16, forward; for relu and gelu also
    each path forced, so the default's thresholds (api/ops/gemm/op.cpp, default_unfused) can be
    read off the table."""
    torch = ctx.torch
    kspec = ctx.kspec
    F = torch.nn.functional
    tact = {"none": lambda t: t, "relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh")}
    rows = []
    for i, (m, n, k) in enumerate(linear_sweep_shapes(ctx.args.quick)):
        g = torch.Generator(device=ctx.dev).manual_seed(ctx.args.seed + i)
        x = torch.randn(m, k, device=ctx.dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device=ctx.dev, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        b = torch.randn(n, device=ctx.dev, generator=g).to(torch.bfloat16)
        for act in ("none", "relu", "gelu"):
            rows_checked = min(m, ctx.args.check_rows)
            want = to_f64(tact[act](F.linear(x[:rows_checked].float(), w.float(), b.float())))
            variants = [("kspec linear", lambda: kspec.ops.linear(x, w, b, act)),
                        ("torch F.linear" + (f" → {act}" if act != "none" else ""),
                         lambda: tact[act](F.linear(x, w, b)))]
            for cfg in {"none": (), "relu": ("", "unfused=1"), "gelu": ("", "unfused=1", "unfused=2")}[act]:
                variants.append((f"kspec gemm {cfg or 'fused'}",
                                 lambda cfg=cfg: kspec.call("gemm", x, w, b, act=act, config=cfg)[0]))
            base = {"shape": f"{m}x{n}x{k}", "m": m, "n": n, "k": k, "act": act, "dtype": "bf16"}
            group = []
            for name, fn in variants:
                if ctx.skipped(name):
                    continue
                row = {**base, "variant": name}
                try:
                    with torch.no_grad():
                        err = rel_error(to_f64(fn()[:rows_checked]), want)
                        row["rel_err"] = err
                        if err > 2e-2:
                            raise RuntimeError(f"wrong result: rel err {err:.2e} against fp32 (first rows)")
                        row.update(ctx.timer.time(fn))
                    row["status"] = "ok"
                except Exception as e:  # noqa: BLE001
                    row["status"], row["error"] = "failed", _short_error(e, 300)
                if name == "kspec linear":
                    row["path"] = linear_path(kspec, x, w, b, act)
                group.append(row)
            ks = next((r for r in group if r["variant"] == "kspec linear" and "gpu_ms" in r), None)
            pt = next((r for r in group if r["variant"].startswith("torch") and "gpu_ms" in r), None)
            for r in group:
                if pt and "gpu_ms" in r:
                    r["torch_over"] = pt["gpu_ms"] / r["gpu_ms"]
            if ks and pt:
                ks["target"] = "ok" if ks["torch_over"] >= LINEAR_RATIO_MIN else "MISSED"
            rows += group
        del x, w, b
        torch.cuda.empty_cache()
    cols = [("shape m×n×k", "shape"), ("act", "act"), ("variant", "variant"), ("path", "path"),
            ("gpu ms", lambda r: _fmt(r.get("gpu_ms"), ".4f")), ("ev ms", lambda r: _fmt(r.get("ev_ms"), ".4f")),
            ("torch / this (gpu)", lambda r: _fmt(r.get("torch_over"), ".2f")), ("target", "target"),
            ("rel err", lambda r: _fmt(r.get("rel_err"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    missed = [f"{r['shape']} {r['act']}" for r in rows if r.get("target") == "MISSED"]
    notes = [f"target: torch ms / kspec linear ms ≥ {LINEAR_RATIO_MIN:.3f} (within 1.1x) for every act; "
             + (f"MISSED at {', '.join(missed)}" if missed else "met everywhere"),
             "path: what the default ran (explain's config; heuristic unless KSPEC_TUNE is on with a tuned "
             "entry). 'kspec gemm fused / unfused=N': that path forced, for setting api/ops/gemm/op.cpp's "
             "default_unfused rule (run with KSPEC_TUNE=off)."]
    return {"results": rows, "tune_mode": os.environ.get("KSPEC_TUNE", "on")}, \
        [Section("linear_sweep: kspec.ops.linear default vs torch F.linear (+ act), bf16 forward", cols, rows, notes)]


# ---------------------------------------------------------------------------------------------
# adamw: one optimizer step over a GPT-350M-like parameter list

ADAMW_MIN_PCT = 92.0  # peers.md: ≤ 3.6 ms for 353.6 M fp32 parameters, i.e. ≥ 92 % of 3.0 TB/s
ADAMW_HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def gpt350m_shapes(vocab=50304, d=1024, layers=24, positions=1024) -> list:
    """GPT-2-medium-like parameter shapes (d 1024, 24 layers, vocabulary padded to 50304, 1024 positions,
    bias-free LayerNorms): token and position embeddings; per layer ln1.w, qkv (3d×d) + bias, attention
    projection (d×d) + bias, ln2.w, MLP up (4d×d) + bias, down (d×4d) + bias; a final LayerNorm weight.
    243 tensors, 354.8 M parameters (peers.md's torch figure was for 353.6 M in 243 tensors; its exact
    shapes are not recorded, the torch peers here run on this same list)."""
    shapes = [(vocab, d), (positions, d)]
    for _ in range(layers):
        shapes += [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,)]


# Bytes each parameter's step must move (the floor): fp32 params: param r+w 8, grad r 4, exp_avg r+w 8,
# exp_avg_sq r+w 8 = 28. bf16 params with an fp32 master: master r+w 8, bf16 param w 2, bf16 grad r 2,
# moments 16 = 28. What other variants move is listed with them.
ADAMW_FLOOR_BYTES_PER_PARAM = 28


def _adamw_check_items(shapes) -> list:
    """(tensor index, slice of its flattened elements) compared with the float64 reference after the first
    step: the embedding's first and last 65537 elements (the update is elementwise without clipping), a
    LayerNorm weight, a qkv weight and its bias, the final LayerNorm."""
    n0 = math.prod(shapes[0])
    e = min(65537, n0)
    return [(0, slice(0, e)), (0, slice(n0 - e, n0)), (2, slice(None)), (3, slice(None)), (4, slice(None)),
            (len(shapes) - 1, slice(None))]


def _adamw_variants(ctx, group):
    torch = ctx.torch
    kspec = ctx.kspec
    h = ADAMW_HYPER
    out = []
    if group == "fp32":
        def kspec_opt(ps):
            return kspec.optim.AdamW(ps, **h)

        def raw(ps):
            # The op itself, lists built once: what the optimizer adds on the host shows against this.
            grads = [p.grad for p in ps]
            m = [torch.zeros_like(p) for p in ps]
            v = [torch.zeros_like(p) for p in ps]
            pos = {id(p): i for i, p in enumerate(ps)}  # not ps.index: == on tensors is elementwise
            kw = dict(lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                      weight_decay=h["weight_decay"], step=1)

            def step():
                kspec.call("adamw", ps, grads, m, v, None, None, None, out=(None, None), **kw)

            return step, lambda p: {"param": p, "exp_avg": m[pos[id(p)]], "exp_avg_sq": v[pos[id(p)]]}

        out += [("kspec.optim.AdamW", "kspec", kspec_opt, 28, "one launch for all tensors"),
                ("kspec.call('adamw')", "kspec", raw, 28, "the raw op, lists built once"),
                ("torch AdamW(fused=True)", "peer", lambda ps: torch.optim.AdamW(ps, fused=True, **h), 28, ""),
                ("torch AdamW(foreach=True)", "peer", lambda ps: torch.optim.AdamW(ps, foreach=True, **h), 28, "")]
    else:
        def master_peer(ps):
            # The torch equivalent of an fp32 master copy: fused AdamW on fp32 copies, gradients cast in,
            # parameters cast back (grad r 2 + w 4, step 28, master r 4 + param w 2 = 40 bytes/param).
            masters = [torch.nn.Parameter(p.detach().float()) for p in ps]
            for mp in masters:
                mp.grad = torch.empty_like(mp)
            opt = torch.optim.AdamW(masters, fused=True, **h)
            grads = [p.grad for p in ps]
            pos = {id(p): i for i, p in enumerate(ps)}

            @torch.no_grad()
            def step():
                torch._foreach_copy_([mp.grad for mp in masters], grads)
                opt.step()
                torch._foreach_copy_(ps, masters)

            return step, lambda p: {"param": masters[pos[id(p)]], **opt.state[masters[pos[id(p)]]]}

        out += [("kspec.optim.AdamW (fp32 master)", "kspec", lambda ps: kspec.optim.AdamW(ps, **h), 28,
                 "state['master'] fp32, bf16 params written from it"),
                ("torch fused on fp32 masters + casts", "peer", master_peer, 40,
                 "_foreach_copy_ grads in, AdamW(fused=True), _foreach_copy_ params out"),
                ("torch AdamW(fused=True), bf16 state", "peer",
                 lambda ps: torch.optim.AdamW(ps, fused=True, **h), 14,
                 "no master: bf16 params and moments (less precise; 14 bytes/param)")]
    return out


def _adamw_group(ctx, group, shapes, seed) -> list:
    import numpy as np

    torch = ctx.torch
    from kspec.reference import adamw as ref

    dt = torch.float32 if group == "fp32" else torch.bfloat16
    g = torch.Generator(device=ctx.dev).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.randn(*s, device=ctx.dev, generator=g) * (0.02 if len(s) == 2 else 0.1)
        params.append(torch.nn.Parameter(p.to(dt)))
    for p in params:
        p.grad = (torch.randn(p.shape, device=ctx.dev, generator=g) * 1e-2).to(dt)
    n_params = sum(p.numel() for p in params)
    items = _adamw_check_items(shapes)
    floor_ms = n_params * ADAMW_FLOOR_BYTES_PER_PARAM / (ctx.args.peak_tbps * 1e12) * 1e3
    rows = []
    for name, impl, make, bpp, note in _adamw_variants(ctx, group):
        row = {"family": "adamw", "group": group, "params": n_params, "tensors": len(params), "variant": name,
               "impl": impl, "note": note, "bytes_per_param": bpp, "bytes": bpp * n_params, "floor_ms": floor_ms,
               "status": "", "errors": {}}
        rows.append(row)
        if ctx.skipped(name):
            row["status"] = "skipped"
            continue
        opt = step = state_of = made = st = None
        try:
            # Before the first step: the checked slices of params (a master copy starts as the bf16
            # param) and grads, fresh zero moments; one step; then the same step in float64.
            p0 = [to_f64(params[i].detach().reshape(-1)[s]) for i, s in items]
            g0 = [to_f64(params[i].grad.reshape(-1)[s]) for i, s in items]
            made = make(params)
            if isinstance(made, tuple):
                step, state_of = made
            else:
                opt = made
                step = opt.step

                def state_of(p, opt=opt):
                    st = opt.state[p]
                    return {"param": st.get("master", p), **st}
            step()
            torch.cuda.synchronize()
            m0 = [np.zeros_like(x) for x in p0]
            v0 = [np.zeros_like(x) for x in p0]
            hp = ADAMW_HYPER
            ref.adamw_step(p0, g0, m0, v0, lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                           weight_decay=hp["weight_decay"], step=1)
            errs, tols = row["errors"], {}
            # fp32 numbers (params, master copies, moments) to fp32's tolerance; bf16 numbers (a bf16
            # parameter, the moments of a bf16-state peer) to bf16's.
            state_tol = TOLERANCE["bfloat16"] if "bf16 state" in name else TOLERANCE["float32"]

            def compare(key, got, want, t):
                errs[key] = max(errs.get(key, 0.0), rel_error(got, want))
                tols[key] = t

            for j, (i, s) in enumerate(items):
                st = state_of(params[i])
                compare(f"param[{i}]", to_f64(st["param"].detach().reshape(-1)[s]), p0[j], state_tol)
                compare(f"exp_avg[{i}]", to_f64(st["exp_avg"].reshape(-1)[s]), m0[j], state_tol)
                compare(f"exp_avg_sq[{i}]", to_f64(st["exp_avg_sq"].reshape(-1)[s]), v0[j], state_tol)
                if dt != torch.float32:
                    compare(f"bf16 param[{i}]", to_f64(params[i].detach().reshape(-1)[s]), p0[j], TOLERANCE["bfloat16"])
            row["max_error"] = max(errs.values())
            row["tolerances"] = tols
            row["valid"] = all(errs[k] <= tols[k] for k in errs)
            row["status"] = "ok" if row["valid"] else "INVALID"
            if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                t = ctx.timer.time(step)
                row.update(t)
                row["gbps"] = row["bytes"] / (t["gpu_ms"] * 1e6)
                row["pct_of_peak"] = 100.0 * row["bytes"] / (t["gpu_ms"] * 1e-3) / (ctx.args.peak_tbps * 1e12)
                row["floor_over_gpu"] = floor_ms / t["gpu_ms"]
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["error"] = _short_error(e)
            if ctx.args.verbose:
                traceback.print_exc()
        print(f"bench: adamw {group} {name}: {row['status']}", file=sys.stderr, flush=True)
        del opt, step, state_of, made, st  # the optimizer's state goes before the next variant's
        torch.cuda.empty_cache()
    for r in rows:
        base = next((b for b in rows if b["impl"] == "kspec" and b["variant"].startswith("kspec.optim")
                     and "gpu_ms" in b), None)
        if base and "gpu_ms" in r:
            r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]
            r["kspec_speedup_ev"] = r["ev_ms"] / base["ev_ms"]
    del params
    torch.cuda.empty_cache()
    return rows


@family("adamw")
def bench_adamw(ctx):
    ctx.torch  # noqa: B018  (no GPU: a clear message before any work)
    shapes = gpt350m_shapes(vocab=4096, d=256, layers=4, positions=256) if ctx.args.quick else gpt350m_shapes()
    n = sum(math.prod(s) for s in shapes)
    print(f"bench: adamw: {len(shapes)} tensors, {n:,} parameters ({n / 1e6:.1f} M)", file=sys.stderr, flush=True)
    rows = []
    for i, group in enumerate(("fp32", "bf16")):
        rows += _adamw_group(ctx, group, shapes, ctx.args.seed + 100 + i)
    peak = ctx.args.peak_tbps
    cols = [
        ("params", lambda r: f"{r['group']}: {r['params'] / 1e6:.1f} M in {r['tensors']}"),
        ("variant", "variant"),
        ("gpu ms", lambda r: _fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: _fmt(r.get("ev_ms"), ".3f")),
        ("host µs", lambda r: _fmt(r.get("host_us"), ".0f")),
        ("B/param", "bytes_per_param"),
        ("GB/s", lambda r: _fmt(r.get("gbps"), ".0f")),
        (f"% of {peak:g} TB/s", lambda r: _fmt(r.get("pct_of_peak"), ".0f")),
        ("floor ms", lambda r: _fmt(r.get("floor_ms"), ".3f")),
        ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
         if "kspec_speedup_gpu" in r else "—"),
        ("max rel err", lambda r: _fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = [
        f"one optimizer step, lr {ADAMW_HYPER['lr']}, betas {ADAMW_HYPER['betas']}, weight decay"
        f" {ADAMW_HYPER['weight_decay']}; floor: {ADAMW_FLOOR_BYTES_PER_PARAM} bytes/param (fp32: param r+w,"
        " grad r, exp_avg r+w, exp_avg_sq r+w; bf16: fp32 master r+w, bf16 param w, bf16 grad r, moments)"
        f" at {peak:g} TB/s; GB/s and % on each variant's own bytes (B/param).",
        "validation: one step from zero moments on the embedding's first/last 65537 elements, a LayerNorm"
        " weight, a qkv weight and bias, the final LayerNorm, against kspec.reference.adamw (float64) before"
        " timing; kspec ×: this variant's time / kspec.optim.AdamW's, same group (> 1: kspec faster).",
    ]
    notes += adamw_targets(rows)
    return {"results": rows, "shapes": [list(s) for s in shapes], "params": n}, \
        [Section("adamw: one step over GPT-350M-like parameters", cols, rows, notes)]


def adamw_targets(rows) -> list:
    lines = ["targets (peers.md: torch fused 3.768 ms = 87.6 % for 353.6 M fp32; kspec ≤ 3.6 ms, "
             f"≥ {ADAMW_MIN_PCT:g} %):"]
    for r in rows:
        if not r["variant"].startswith("kspec.optim") or "gpu_ms" not in r:
            continue
        ok = r["pct_of_peak"] >= ADAMW_MIN_PCT
        line = (f"  {r['group']} kspec.optim.AdamW: {r['gpu_ms']:.3f} ms gpu ({r['ev_ms']:.3f} ev), "
                f"{r['pct_of_peak']:.1f} % (≥ {ADAMW_MIN_PCT:g} %) {'ok' if ok else 'MISSED'}")
        peer = next((p for p in rows if p["group"] == r["group"] and p["impl"] == "peer" and "gpu_ms" in p), None)
        if peer:
            line += f"; × {peer['variant']} {peer['gpu_ms'] / r['gpu_ms']:.2f}"
        lines.append(line)
    return lines


def _kspec_cli_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    env["KSPEC_CACHE_DIR"] = cache_dir
    try:  # the child must import the same kspec as this process
        import kspec

        parent = os.path.dirname(os.path.dirname(os.path.abspath(kspec.__file__)))
        env["PYTHONPATH"] = parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    except Exception:
        pass
    return env


def _run_cli_compile(args, cache_dir: str) -> dict:
    cmd = [sys.executable, "-m", "kspec.cli", "compile", "norm_act.fwd", "--dtype", "bf16", "--arch", args.jit_arch,
           "--param", f"hidden={args.jit_hidden}", "--json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_kspec_cli_env(cache_dir), timeout=600)
    wall_ms = (time.perf_counter() - t0) * 1e3
    if p.returncode != 0:
        raise RuntimeError(f"kspec.cli compile exited {p.returncode}: {(p.stderr or p.stdout).strip()[-1500:]}")
    text = p.stdout.strip()
    try:
        rep = json.loads(text)
    except json.JSONDecodeError:
        line = next((ln for ln in reversed(text.splitlines()) if ln.lstrip().startswith(("{", "["))), "")
        rep = json.loads(line)
    if isinstance(rep, list):
        rep = rep[0]
    rep = {k: rep.get(k) for k in ("kernel", "key", "source", "compile_ms", "load_ms", "registers", "spill_bytes",
                                   "arch", "config")}
    rep["process_wall_ms"] = wall_ms
    return rep


def jit_compile_times(ctx) -> dict:
    args = ctx.args
    cold, disk = [], []
    for _ in range(args.jit_reps):
        d = tempfile.mkdtemp(prefix="kspec-bench-cache-")
        try:
            c = _run_cli_compile(args, d)
            h = _run_cli_compile(args, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        if c["source"] != "compiled":
            raise RuntimeError(f"a fresh cache directory gave source {c['source']!r}, not 'compiled'")
        if h["source"] != "disk":
            raise RuntimeError(f"the second process gave source {h['source']!r}, not 'disk'")
        cold.append(c)
        disk.append(h)
    return {"command": f"python3 -m kspec.cli compile norm_act.fwd --dtype bf16 --arch {args.jit_arch} "
                       f"--param hidden={args.jit_hidden} --json",
            "cold_compile_ms": _median([c["compile_ms"] for c in cold]),
            "cold_load_ms": _median([c["load_ms"] for c in cold]),
            "disk_hit_load_ms": _median([h["load_ms"] for h in disk]),
            "cold": cold, "disk": disk}


def _cupy_add_one(device: int):
    import cupy as cp

    cp.cuda.Device(device).use()

    kernel = cp.RawKernel(r'''
extern "C" __global__ void add_one(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}''', "add_one")
    a = cp.arange(256, dtype=cp.float32)
    n = cp.int32(256)
    call = lambda: kernel((1,), (256,), (a, n))  # noqa: E731
    before = a.copy()
    call()
    cp.cuda.Device().synchronize()
    if not bool(cp.all(a == before + 1)):
        raise RuntimeError("CuPy add_one gave wrong values")
    return call, cp.cuda.Device().synchronize


try:  # a Triton kernel is defined at import (triton.jit reads its source); only where triton imports
    import triton
    import triton.language as tl

    @triton.jit
    def _triton_add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)
except Exception:  # noqa: BLE001  (no triton, or a triton that cannot initialize here)
    triton = None


def jit_python_overhead(ctx) -> list:
    """Host time per call of tiny launches (1 x 256 fp32): the GPU side is a few µs, so this is the
    Python → launch overhead of each path."""
    torch = ctx.torch
    kspec = ctx.kspec
    from kspec.reference import norm_act as ref

    K = kspec.ops
    calls = ctx.args.calls
    dev = ctx.dev
    sync = torch.cuda.synchronize
    g = torch.Generator(device=dev)
    g.manual_seed(ctx.args.seed)
    x = torch.randn(1, 256, generator=g, device=dev)
    w = 1 + 0.1 * torch.randn(256, generator=g, device=dev)
    b = 0.1 * torch.randn(256, generator=g, device=dev)
    kw = dict(norm="layernorm", act="identity", eps=1e-5)
    y_ref = ref.norm_act_fwd(to_f64(x), to_f64(w), to_f64(b), "layernorm", "identity", 1e-5)[0]
    y_out, mean_out, rstd_out = (torch.empty_like(x), torch.empty(1, device=dev), torch.empty(1, device=dev))

    def check_y(y):
        err = rel_error(to_f64(y), y_ref)
        if not err <= TOLERANCE["float32"]:
            raise RuntimeError(f"output differs from the float64 reference (rel. error {err:.2e})")
        return err

    def v_raw():
        return check_y(K.norm_act_fwd(x, w, b, **kw)[0]), lambda: K.norm_act_fwd(x, w, b, **kw), sync

    def v_custom():
        return check_y(K.norm_act(x, w, b, **kw)), lambda: K.norm_act(x, w, b, **kw), sync

    def v_call_out():
        def f():
            return kspec.call("norm_act.fwd", x, w, b, out=(y_out, mean_out, rstd_out), **kw)

        y_out.fill_(float("nan"))
        f()
        return check_y(y_out), f, sync

    def v_add():
        a = torch.arange(256, device=dev, dtype=torch.float32)
        before = a.clone()
        a.add_(1)
        if not torch.equal(a, before + 1):
            raise RuntimeError("add_ gave wrong values")
        return 0.0, lambda: a.add_(1), sync

    def v_cupy():
        f, s = _cupy_add_one(ctx.args.device)
        return 0.0, f, s

    def v_triton():
        if triton is None:
            raise ImportError("triton is not importable")
        a = torch.arange(256, device=dev, dtype=torch.float32)
        before = a.clone()

        def f():
            _triton_add_one[(1,)](a, 256, BLOCK=256)

        f()
        sync()
        if not torch.equal(a, before + 1):
            raise RuntimeError("Triton add_one gave wrong values")
        return 0.0, f, sync

    variants = [
        ("kspec.ops.norm_act_fwd (raw op, allocates outputs)", "kspec", v_raw),
        ("kspec.ops.norm_act (custom op)", "kspec", v_custom),
        ("kspec.call(..., out=preallocated)", "kspec", v_call_out),
        ("torch x.add_(1)", "peer", v_add),
        ("CuPy RawKernel call", "peer", v_cupy),
        ("Triton kernel call", "peer", v_triton),
    ]
    rows = []
    for name, impl, make in variants:
        row = {"variant": name, "impl": impl, "problem": "float32[1, 256]"}
        if ctx.skipped(name):
            row["status"] = "skipped"
        else:
            try:
                err, fn, s = make()
                row["rel_error"] = err
                row.update(host_per_call_us(fn, s, calls))
                row["status"] = "ok"
            except Exception as e:
                row["status"] = "error"
                row["error"] = _short_error(e)
        rows.append(row)
    return rows


def jit_dispatch_bin(path: str) -> dict:
    p = subprocess.run([path], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{path} exited {p.returncode}: {(p.stderr or p.stdout).strip()[-1500:]}")
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.lstrip().startswith("{")), "")
    return json.loads(line)


@family("jit")
def bench_jit(ctx):
    args = ctx.args
    data: dict = {}
    table: list = []

    def target_row(metric, value, unit, target=None, lower_is_better=True, note=""):
        ok = None
        if target is not None and value is not None and not math.isnan(value):
            ok = value <= target if lower_is_better else value >= target
        table.append({"metric": metric, "value": _fmt(value, ".2f") + f" {unit}" if value is not None else "—",
                      "target": f"≤ {target:g} {unit}" if target is not None else "",
                      "verdict": "" if ok is None else ("ok" if ok else "MISSED"), "note": note})

    try:
        ct = jit_compile_times(ctx)
        data["compile"] = ct
        target_row(f"cold compile, norm_act.fwd bf16 hidden={args.jit_hidden} (fresh KSPEC_CACHE_DIR)",
                   ct["cold_compile_ms"], "ms", JIT_COLD_COMPILE_MAX_MS,
                   note=f"median of {args.jit_reps} processes; CuPy 118 ms, Triton 1.58 s (peers.md)")
        target_row("disk hit, same spec in a new process", ct["disk_hit_load_ms"], "ms", JIT_DISK_HIT_MAX_MS,
                   note="load_ms of source 'disk'")
    except Exception as e:
        data["compile_error"] = _short_error(e)
        table.append({"metric": "cold compile / disk hit", "value": "—", "target": "", "verdict": "error",
                      "note": _brief(data["compile_error"])})

    try:
        rows = jit_python_overhead(ctx)
        data["python_overhead"] = rows
        for r in rows:
            target = JIT_PY_CALL_MAX_US if r["variant"].startswith("kspec.ops") else None
            if r["status"] == "ok":
                target_row(f"host per call: {r['variant']}", r["us"], "µs", target,
                           note=f"{r['calls']} calls back to back; incl. final sync {r['us_incl_sync']:.2f} µs")
            else:
                table.append({"metric": f"host per call: {r['variant']}", "value": "—", "target": "",
                              "verdict": r["status"], "note": _brief(r.get("error", ""))})
    except Exception as e:
        data["python_overhead_error"] = _short_error(e)
        table.append({"metric": "Python per-call overhead", "value": "—", "target": "", "verdict": "error",
                      "note": _brief(data["python_overhead_error"])})

    if args.dispatch_bin:
        try:
            d = jit_dispatch_bin(args.dispatch_bin)
            data["dispatch_cpp"] = d
            target_row("C++ raw cuLaunchKernel per call", d.get("raw_us"), "µs", note="same kernel and arguments")
            for k, label in (("call", "kspec::call (Params built per call)"),
                             ("call_prebuilt_params", "kspec::call (Params built once)"),
                             ("typed", "kspec::ops::norm_act_fwd")):
                if f"{k}_us" in d:
                    target_row(f"C++ {label} per call", d[f"{k}_us"], "µs")
                    target_row(f"C++ {label} − raw", d[f"{k}_minus_raw_us"], "µs", JIT_CPP_OVER_RAW_MAX_US)
            if not d.get("same_kernel", True) or not d.get("outputs_bitwise_equal", True):
                table.append({"metric": "C++ dispatch sanity", "value": "", "target": "", "verdict": "WARNING",
                              "note": f"same_kernel={d.get('same_kernel')}, "
                                      f"outputs_bitwise_equal={d.get('outputs_bitwise_equal')}"})
        except Exception as e:
            data["dispatch_cpp_error"] = _short_error(e)
            table.append({"metric": "C++ dispatch benchmark", "value": "—", "target": "", "verdict": "error",
                          "note": _brief(data["dispatch_cpp_error"])})

    cols = [("metric", "metric"), ("value", "value"), ("target", "target"), ("verdict", "verdict"), ("note", "note")]
    notes = ["peers.md: CuPy RawKernel call 7.4 µs, torch add_ 9.3 µs, Triton call 12.2 µs, raw cuLaunchKernel 4.1 µs"]
    return data, [Section("jit: compile, disk hit and host overhead per call", cols, table, notes)]


# ---------------------------------------------------------------------------------------------


def environment(ctx) -> dict:
    env = {"python": platform.python_version(), "host": platform.node(), "argv": sys.argv,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "peak_tbps": ctx.args.peak_tbps, "quick": ctx.args.quick}
    for mod in ("torch", "triton", "cupy", "liger_kernel", "numpy", "kspec"):
        try:
            m = __import__(mod)
            env[f"{mod}_version"] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            env[f"{mod}_version"] = f"unavailable ({type(e).__name__})"
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(ctx.args.device)
            env["torch_cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    try:
        import kspec

        env["kspec_doctor"] = dict(kspec.doctor())
    except Exception as e:  # noqa: BLE001
        env["kspec_doctor"] = f"unavailable ({_short_error(e, 200)})"
    return env


def _json_safe(v):
    """Non-finite floats as strings ("inf", "nan"): strict JSON readers reject Infinity and NaN."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", metavar="NAME",
                   help=f"one of {', '.join(FAMILIES)} or 'all' (default); repeatable or comma-separated")
    p.add_argument("--quick", action="store_true", help="small shapes, fewer calls: a smoke test, not figures")
    p.add_argument("--json", metavar="OUT", help="write every result (and the environment) to this file")
    p.add_argument("--reps", type=int, help="timed calls per variant, median taken (default 50; --quick 30)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--check-rows", type=int, default=256, help="rows compared with the float64 reference")
    p.add_argument("--peak-tbps", type=float, default=3.0, help="the bandwidth %% is of this (H100 copy: 3.0)")
    p.add_argument("--peak-tflops", type=float, default=H100_DENSE_TFLOPS["bf16"],
                   help="gemm: bf16/fp16 %% of peak is of this (H100 SXM dense: 989.4)")
    p.add_argument("--skip", action="append", metavar="TEXT", help="skip variants whose name contains TEXT")
    p.add_argument("--time-invalid", action="store_true",
                   help="time kspec variants that fail validation too (failing peers are always timed, flagged)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dispatch-bin", metavar="PATH", help="the kspec_dispatch_bench binary (C++ host overhead)")
    p.add_argument("--jit-hidden", type=int, default=4224, help="a hidden size no other run compiles")
    p.add_argument("--jit-arch", default="sm_90")
    p.add_argument("--jit-reps", type=int, default=3, help="cold-compile processes (each with a fresh cache)")
    p.add_argument("--calls", type=int, default=2000, help="back-to-back calls per host-overhead sample")
    p.add_argument("--verbose", "-v", action="store_true", help="print tracebacks of failing variants")
    p.add_argument("--scan-op", choices=("fwd", "bwd"), default="fwd", help="selective_scan_configs: the op")
    p.add_argument("--scan-shape", default="8x2048x2048", metavar="BxDxL", help="selective_scan_configs: the shape")
    p.add_argument("--scan-shapes", metavar="BxDxL,...", help="selective_scan: these shapes instead of the default four"
                   " (the small ones of the outside test: 4x1536x1000,2x4096x333,1x2048x512,16x768x256,8x2560x1024)")
    p.add_argument("--scan-own-states", action="store_true",
                   help="selective_scan_configs: the backward without the forward's states (it makes its own)")
    p.add_argument("--scan-config", action="append", metavar="CONFIG",
                   help="selective_scan_configs: a config to time (repeatable; default: a forward sweep)")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 30 if args.quick else 50
    if args.reps < 30:
        print(f"bench: --reps {args.reps} is below the method's 30; the medians are less stable", file=sys.stderr)

    names = []
    for f in args.family or ["all"]:
        names += [n.strip() for n in f.split(",") if n.strip()]
    if "all" in names:
        names = list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; known: {', '.join(FAMILIES)}")

    ctx = Context(args)
    report = {"environment": environment(ctx), "families": {}, "errors": {}}
    failed = False
    no_gpu = 0
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                data, sections = FAMILIES[name](ctx)
                data["seconds"] = time.perf_counter() - t0
                report["families"][name] = data
                for s in sections:
                    print_section(s)
            except NoGpu as e:
                no_gpu += 1
                report["errors"][name] = f"no GPU: {e}"
                print(f"bench: family {name}: no GPU ({e}); nothing measured", file=sys.stderr)
            except Exception as e:
                failed = True
                report["errors"][name] = _short_error(e, 8000)
                print(f"bench: family {name} failed: {_short_error(e, 1000)}", file=sys.stderr)
                if args.verbose:
                    traceback.print_exc()
        try:
            import kspec

            report["environment"]["kspec_counters"] = dict(kspec.counters())
        except Exception:  # noqa: BLE001
            pass
    finally:
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(_json_safe(report), f, indent=1, default=str)
            print(f"bench: wrote {args.json}")
    if no_gpu and no_gpu == len(names):
        return 2
    return 1 if failed or no_gpu else 0


if __name__ == "__main__":
    sys.exit(main())
