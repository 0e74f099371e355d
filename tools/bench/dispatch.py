"""Host cost of one call (issue 28's table): kspec's entry points and their peers in one process, on
problems so small that only dispatch is measured. Each row is the median host time of 2000 calls after
200 warm-ups, each call timed alone with perf_counter_ns, no sync inside the loop (the GPU drains
between rows). A second table times a training step (forward + backward through autograd) per call in
a loop: wall time per step with one sync at the end, and the host time the loop took to enqueue it.
With the torch extension loaded (kspec._native), each kspec row runs twice, through the extension and
on the pure path (kspec._C.call_torch), and the extension's own doors have rows ("ext"); a norm_act or
linear row with a gradient runs a third time on the record node ("node": the forward from Python and
_torch_ext.record's node with the surface's Python backward, as before call_grad).

    python3 tools/bench/bench.py --family dispatch [--json FILE] [--dispatch-bin build/gpu/tools/bench/kspec_dispatch_bench]
    python3 tools/bench/dispatch.py [--json FILE] [--dispatch-bin ...]      # the same, alone
    python3 tools/bench/dispatch.py --mhc-decode [--json FILE]   # mhc.pre at T 8: split plan against algo=decode

A bench family (FAMILY below): the runner calls run(ctx), ctx.dispatch_bin from jit's --dispatch-bin option
(None to skip the C++ rows)."""
from __future__ import annotations

import argparse
import json
import subprocess
import time

FAMILY = "dispatch"
DESCRIPTION = "host µs per call of kspec's entry points beside their peers (issue 28's table)"

CALLS, WARMUP = 2000, 200
SYNC_EVERY = 100  # calls between untimed synchronizes: the launch queue never fills
STEP_WARMUP = 20
# A step table's variants run in ROUNDS rounds of ROUND_STEPS steps, in turn, each round starting at the next
# variant: a single 200-step loop per variant, one after another, put torch's own norm step at 117.5 µs and,
# later in the same run (run 22), at 147.1 — the host's drift, not the ops, decided the row.
ROUNDS, ROUND_STEPS = 20, 20


def host_us(fn, calls=CALLS, warmup=WARMUP) -> float:
    """Median host microseconds of one fn() call. The GPU is synchronized (untimed) every SYNC_EVERY calls:
    where a call's kernels take longer than its host work (mhc.pre at decode), a full launch queue would
    otherwise make later launches wait for the GPU and time the GPU, not the host."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = [0] * calls
    clock = time.perf_counter_ns
    for i in range(calls):
        if i % SYNC_EVERY == 0:
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        t[i] = clock() - t0
    torch.cuda.synchronize()
    t.sort()
    return t[calls // 2] / 1e3


def gpu_us(fn, calls=50) -> float:
    """Median GPU µs of one fn() call's kernels: each call queued behind a spin kernel (torch.cuda._sleep) so that
    its events time the kernels alone, not the host's launch gaps. Where this is near host_us, the host loop was
    waiting for the GPU (the launch queue full), not the other way round."""
    import torch

    fn()
    t = []
    for _ in range(calls):
        torch.cuda._sleep(200_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        t.append((s, e))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in t)
    return ms[len(ms) // 2] * 1e3


def interleaved_steps(variants, rounds=ROUNDS, steps=ROUND_STEPS, warmup=STEP_WARMUP) -> list:
    """Training steps of several variants (the peer first), interleaved: `rounds` rounds of `steps` steps of
    each variant in turn, round r starting at variant r (none owns the warm or the cold end of the run, and
    drift between rounds moves every variant of a round alike). variants: [(fn, path)], path a key of _PATHS
    or "". Per variant (wall µs per step with one sync at a round's end, host µs per step spent enqueueing,
    each the median over rounds; and the median over rounds of its wall / the peer's wall in that round)."""
    import contextlib

    import torch

    def ctx(path):
        return _PATHS[path]() if path in _PATHS else contextlib.nullcontext()
    for fn, path in variants:
        with ctx(path):
            for _ in range(warmup):
                fn()
    torch.cuda.synchronize()
    clock = time.perf_counter_ns
    wall = [[] for _ in variants]
    host = [[] for _ in variants]
    for r in range(rounds):
        for k in range(len(variants)):
            i = (r + k) % len(variants)
            fn, path = variants[i]
            with ctx(path):
                torch.cuda.synchronize()
                t0 = clock()
                for _ in range(steps):
                    fn()
                t1 = clock()
                torch.cuda.synchronize()
                t2 = clock()
            wall[i].append((t2 - t0) / 1e3 / steps)
            host[i].append((t1 - t0) / 1e3 / steps)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return [(med(wall[i]), med(host[i]), med([a / b for a, b in zip(wall[i], wall[0])])) for i in range(len(variants))]


def _cupy_row():
    """A CuPy RawKernel launch of a one-thread kernel: the floor of a Python launch."""
    try:
        import cupy
    except ImportError:
        return None
    k = cupy.RawKernel(r'extern "C" __global__ void nop(float* x) { if (threadIdx.x == 1000) x[0] = 1; }', "nop")
    x = cupy.zeros(1, dtype=cupy.float32)
    return lambda: k((1,), (32,), (x,))


def call_rows():
    """[(group, name, fn or None)]: a None fn prints as n/a (the peer is not installed)."""
    import torch
    import torch.nn.functional as F

    import kspec
    from kspec._core import _call_general, _call_python

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(4, 256, device=dev, dtype=bf)
    w = torch.ones(256, device=dev, dtype=bf)
    xg = x.clone().requires_grad_()
    y, mean, rstd = torch.empty_like(x), torch.empty(4, device=dev), torch.empty(4, device=dev)
    lx = torch.randn(4, 256, device=dev, dtype=bf)
    lw = torch.randn(256, 256, device=dev, dtype=bf)
    lxg = lx.clone().requires_grad_()
    b, d, t, n = 1, 16, 32, 16
    u = torch.randn(b, d, t, device=dev, dtype=bf)
    delta = torch.rand(b, d, t, device=dev, dtype=bf)
    A = -torch.rand(d, n, device=dev)
    B = torch.randn(b, 1, n, t, device=dev, dtype=bf)
    C = torch.randn(b, 1, n, t, device=dev, dtype=bf)
    D = torch.randn(d, device=dev)
    ug = u.clone().requires_grad_()
    nm = dict(norm="rmsnorm", act="identity", eps=1e-5)
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as mamba_scan
    except ImportError:
        mamba_scan = None
    # issue 34's decode shape (T = 8, n = 4, D = 4096, bf16), without grad as a decode step runs (the peer too)
    T, hn, hd = 8, 4, 4096
    hx = torch.randn(T, hn, hd, device=dev, dtype=bf)
    phi = torch.randn(hn * hn + 2 * hn, hn * hd, device=dev) * 0.01
    alpha, hbias = torch.full((3,), 0.01, device=dev), torch.zeros(hn * hn + 2 * hn, device=dev)
    hxf, hw = hx.view(T, hn * hd), torch.ones(hn * hd, device=dev, dtype=bf)
    hxg = hx.clone().requires_grad_()
    hf = torch.randn(T, hd, device=dev, dtype=bf)
    h_post, h_res = torch.rand(T, hn, device=dev), torch.rand(T, hn, hn, device=dev)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run
    return [
        ("launch", "CuPy RawKernel launch", _cupy_row()),
        ("launch", "torch F.rms_norm [4, 256] bf16", lambda: F.rms_norm(x, (256,), w, 1e-5)),
        ("launch", "torch x.add(1)", lambda: x.add(1)),
        ("call", "kspec.call norm_act.fwd, out=", lambda: kspec.call("norm_act.fwd", x, w, None, out=(y, mean, rstd),
                                                                    **nm)),
        ("call", "kspec.call norm_act.fwd (allocated)", lambda: kspec.call("norm_act.fwd", x, w, None, **nm)),
        ("call", "kspec.call's Python function (before), out=",
         lambda: _call_python("norm_act.fwd", x, w, None, out=(y, mean, rstd), **nm)),
        ("call", "kspec.call's Python function (before), allocated",
         lambda: _call_python("norm_act.fwd", x, w, None, **nm)),
        ("call", "general path (any framework), allocated",
         lambda: _call_general("norm_act.fwd", (x, w, None), None, None, nm)),
        ("norm", "torch F.rms_norm", lambda: F.rms_norm(x, (256,), w, 1e-5)),
        ("norm", "kspec.ops.norm_act (no grad)", lambda: kspec.ops.norm_act(x, w, None, norm="rmsnorm")),
        ("norm", "torch F.rms_norm (input requires grad)", lambda: F.rms_norm(xg, (256,), w, 1e-5)),
        ("norm", "kspec.ops.norm_act (input requires grad)", lambda: kspec.ops.norm_act(xg, w, None, norm="rmsnorm")),
        ("linear", "torch F.linear [4, 256] x [256, 256]", lambda: F.linear(lx, lw)),
        ("linear", "kspec.ops.linear (no grad)", lambda: kspec.ops.linear(lx, lw)),
        ("linear", "torch F.linear (input requires grad)", lambda: F.linear(lxg, lw)),
        ("linear", "kspec.ops.linear (input requires grad)", lambda: kspec.ops.linear(lxg, lw)),
        ("scan", "mamba_ssm selective_scan_fn [1, 16, 32]",
         None if mamba_scan is None else lambda: mamba_scan(u, delta, A, B, C, D, delta_softplus=True)),
        ("scan", "kspec.ops.selective_scan_fn (no grad)",
         lambda: kspec.ops.selective_scan_fn(u, delta, A, B, C, D, delta_softplus=True)),
        ("scan", "mamba_ssm selective_scan_fn (input requires grad)",
         None if mamba_scan is None else lambda: mamba_scan(ug, delta, A, B, C, D, delta_softplus=True)),
        ("scan", "kspec.ops.selective_scan_fn (input requires grad)",
         lambda: kspec.ops.selective_scan_fn(ug, delta, A, B, C, D, delta_softplus=True)),
        ("mhc", "torch F.rms_norm [8, 4*4096] (no_grad)", no_grad(lambda: F.rms_norm(hxf, (hn * hd,), hw, 1e-6))),
        ("mhc", "kspec.call mhc.pre.fwd (no_grad, 6 outputs)", no_grad(lambda: kspec.call("mhc.pre.fwd", hx, phi, alpha,
                                                                                         hbias, None))),
        ("mhc", "kspec.ops.mhc_pre T=8 n=4 D=4096 (no_grad)", no_grad(lambda: kspec.ops.mhc_pre(hx, phi, alpha, hbias))),
        ("mhc", "kspec.ops.mhc_post (no_grad)", no_grad(lambda: kspec.ops.mhc_post(hx, hf, h_post, h_res))),
        ("mhc", "torch F.rms_norm [8, 4*4096] (input requires grad)",
         lambda: F.rms_norm(hxg.view(T, hn * hd), (hn * hd,), hw, 1e-6)),
        ("mhc", "kspec.ops.mhc_pre (input requires grad)", lambda: kspec.ops.mhc_pre(hxg, phi, alpha, hbias)),
    ]


def piece_rows():
    """Where a call's host time goes: each piece of the general (any-framework) path timed alone, and the
    torch layers around the ops (the autograd Function, torch.library's dispatch of a custom op)."""
    import torch

    import kspec
    from kspec import _C
    from kspec._tensors import current_stream, describe, empty, framework_of

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(4, 256, device=dev, dtype=bf)
    w = torch.ones(256, device=dev, dtype=bf)
    y, mean, rstd = torch.empty_like(x), torch.empty(4, device=dev), torch.empty(4, device=dev)
    nm = dict(norm="rmsnorm", act="identity", eps=1e-5)
    descs = [describe(x), describe(w), None]
    outs = [describe(y), describe(mean), describe(rstd)]
    stream = current_stream("torch", 0)

    class Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g
    xg = x.clone().requires_grad_()
    from kspec import _torch
    return [
        ("piece", "describe(torch tensor), Python", lambda: describe(x)),
        ("piece", "framework_of(3 args)", lambda: framework_of((x, w, None))),
        ("piece", "current_stream(torch)", lambda: current_stream("torch", 0)),
        ("piece", "torch.empty([4, 256] bf16) x1", lambda: empty("torch", "bfloat16", (4, 256), 0)),
        ("piece", "_C.infer_outputs (cached signature)", lambda: _C.infer_outputs("norm_act.fwd", descs, nm)),
        ("piece", "_C.call, descriptors given", lambda: _C.call("norm_act.fwd", descs, outs, nm, stream, None)),
        ("piece", "_C.call, forced config (no call cache)",
         lambda: _C.call("norm_act.fwd", descs, outs, nm, stream,
                         kspec.explain("norm_act.fwd", x, w, None, **nm).config)),
        ("piece", "torch.compiler.is_compiling()", torch.compiler.is_compiling),
        ("piece", "autograd.Function.apply (identity, grad)", lambda: Nop.apply(xg)),
        ("piece", "custom op kspec::norm_act_fwd (no grad)",
         lambda: _torch.norm_act.fwd_op(x, w, None, "rmsnorm", "identity", 1e-5)),
    ]


def step_rows():
    """Forward + backward per step: norm_act against torch, the scan at issue 33's host-bound shape."""
    import torch
    import torch.nn.functional as F

    import kspec

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(4, 256, device=dev, dtype=bf, requires_grad=True)
    w = torch.ones(256, device=dev, dtype=bf, requires_grad=True)
    gy = torch.randn(4, 256, device=dev, dtype=bf)

    def norm_step(fn):
        def step():  # gradients reset as zero_grad() does: no accumulation kernels (as the other steps)
            x.grad = w.grad = None
            fn().backward(gy)
        return step
    lx = torch.randn(4, 256, device=dev, dtype=bf, requires_grad=True)
    lw = (torch.randn(256, 256, device=dev, dtype=bf) * 0.06).requires_grad_()
    lb = torch.zeros(256, device=dev, dtype=bf, requires_grad=True)

    def linear_step(fn):
        def step():
            for v in (lx, lw, lb):
                v.grad = None
            fn().backward(gy)
        return step
    b, d, t, n = 2, 4096, 333, 16
    g = torch.Generator(device=dev).manual_seed(0)
    leaves = dict(u=torch.randn(b, d, t, device=dev, dtype=bf, generator=g),
                  delta=torch.rand(b, d, t, device=dev, dtype=bf, generator=g) * 0.5 - 1,
                  A=-(0.25 + torch.rand(d, n, device=dev, generator=g)),
                  B=torch.randn(b, 1, n, t, device=dev, dtype=bf, generator=g),
                  C=torch.randn(b, 1, n, t, device=dev, dtype=bf, generator=g),
                  D=torch.randn(d, device=dev, generator=g),
                  z=torch.randn(b, d, t, device=dev, dtype=bf, generator=g),
                  delta_bias=torch.randn(d, device=dev, generator=g) * 0.1)
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    dout = torch.randn(b, d, t, device=dev, dtype=bf, generator=g)
    order = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")

    def scan_step(fn):
        def step():
            for v in leaves.values():
                v.grad = None
            fn(*(leaves[k] for k in order), delta_softplus=True).backward(dout)
        return step
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as mamba_scan
    except ImportError:
        mamba_scan = None
    return [
        ("norm step", "torch F.rms_norm fwd+bwd [4, 256]", norm_step(lambda: F.rms_norm(x, (256,), w, 1e-5))),
        ("norm step", "kspec.ops.norm_act fwd+bwd", norm_step(lambda: kspec.ops.norm_act(x, w, None, norm="rmsnorm"))),
        ("lin step", "torch F.linear + relu fwd+bwd [4, 256] x [256, 256]",
         linear_step(lambda: F.relu(F.linear(lx, lw, lb)))),
        ("lin step", "kspec.ops.linear relu fwd+bwd", linear_step(lambda: kspec.ops.linear(lx, lw, lb, "relu"))),
        ("scan step", "mamba_ssm fwd+bwd (2, 4096, 333)", None if mamba_scan is None else scan_step(mamba_scan)),
        ("scan step", "kspec fwd+bwd (2, 4096, 333)", scan_step(kspec.ops.selective_scan_fn)),
    ]


def native_rows():
    """The torch extension's own doors (kspec._torch_ext): kspec.call's C++ path called directly, and the
    registry op as a dispatcher op (kspec_ops::norm_act_fwd, what torch.compile may trace)."""
    import torch

    from kspec import _native, _torch

    if _native.ext is None:
        return []
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(4, 256, device=dev, dtype=bf)
    w = torch.ones(256, device=dev, dtype=bf)
    nm = dict(norm="rmsnorm", act="identity", eps=1e-5)
    op = torch.ops.kspec_ops.norm_act_fwd.default
    lx, lw = torch.randn(4, 256, device=dev, dtype=bf), torch.randn(256, 256, device=dev, dtype=bf)
    # norm_act with grad's one C++ call as the surface made it before (a params dict, every output wrapped and
    # the tuple indexed in Python) and now ((names, values), y alone): the same node, the same kernels
    xg = torch.randn(4, 256, device=dev, dtype=bf, requires_grad=True)
    fwd_op, bwd_op, names, pick, bwd_params, codes, grad_of = _torch.norm_act.grad_call
    args = (xg, w, None, "rmsnorm", "identity", 1e-5, True)
    name, tensors = _torch.norm_act.node_name, _torch.norm_act.pick_tensors
    return [
        ("ext", "linear's surface (no grad; ops.linear's path before)",
         lambda: _torch.linear_surface(lx, lw, None, "none", False)),
        ("ext", "_torch_ext.call norm_act.fwd (allocated)", lambda: _native.ext.call("norm_act.fwd", (x, w, None),
                                                                                     None, nm)),
        ("ext", "dispatcher op kspec_ops::norm_act_fwd (allocated)", lambda: op(x, w, None, **nm)),
        ("ext", "call_grad norm_act, before (params dict, all outputs)",
         lambda: _native.ext.call_grad(name, fwd_op, bwd_op, tensors(args), dict(zip(names, pick(args))), bwd_params,
                                       codes, grad_of)[0]),
        ("ext", "call_grad norm_act, now ((names, values), y alone)",
         lambda: _native.ext.call_grad(name, fwd_op, bwd_op, tensors(args), (names, pick(args)), bwd_params, codes,
                                       grad_of, 0)),
    ]


class _RecordNode:
    """norm_act's and linear's gradient-wanted path as before call_grad: the forward from Python, then the
    C++ node of _torch_ext.record calling the surface's Python backward."""

    def __enter__(self):
        from kspec import _torch

        self.saved = _torch.norm_act.grad_call, _torch._LINEAR_GRAD_ARGS
        _torch.norm_act.grad_call, _torch._LINEAR_GRAD_ARGS = None, {}

    def __exit__(self, *exc):
        from kspec import _torch

        _torch.norm_act.grad_call, _torch._LINEAR_GRAD_ARGS = self.saved


class _PurePath:
    """kspec.call's torch path as without the extension (kspec._C.call_torch), for the same rows twice."""

    def __enter__(self):
        from kspec import _C, _core

        self.saved = _core._call_torch, _core._call_some, _core.call
        _core.use_torch_ext(_C.call_torch)
        self.node = _RecordNode()  # call_grad calls the extension's C++ path itself
        self.node.__enter__()

    def __exit__(self, *exc):
        from kspec import _core

        _core.use_torch_ext(*self.saved)
        self.node.__exit__(*exc)


_PATHS = {"pure": _PurePath, "node": _RecordNode}


def _twins(rows):
    """Each kspec row, then with the extension loaded the same row on the pure path ("pure" in its path
    column), and a norm_act / linear row with a gradient on the record node ("node": before call_grad):
    [(group, name, path, fn or None)]."""
    from kspec import _native

    out = []
    for group, name, fn in rows:
        kspec_row = name.startswith("kspec") and fn is not None
        out.append((group, name, "ext" if kspec_row and _native.ext is not None else "", fn))
        if kspec_row and _native.ext is not None:
            out.append((group, name, "pure", fn))
            if ("norm_act" in name or "linear" in name) and ("requires grad" in name or "bwd" in name):
                out.append((group, name, "node", fn))
    return out


def norm_step_breakdown(trace: bool = False, rounds: int = 5, steps: int = 100) -> list:
    """Where a norm_act training step's host time goes (issue 28's one row over its peer), each variant in the
    same process and interleaved (`rounds` rounds of `steps` steps each, variants in turn, so that no variant
    owns the warm or the cold end of the run): per step the forward's and the backward's host µs (each call
    timed alone, medians over every round) and the wall µs of a round with one sync at its end (median of the
    rounds); the kernels launched per step (torch.profiler: cuLaunchKernel / cudaLaunchKernel events); with
    `trace`, the profiler's rows by self CPU time for each variant's steps. Variants: torch F.rms_norm, kspec
    with call_grad's C++ node (ext: the default), the record node (node: the forward from Python, the
    surface's Python backward), and, in each kspec variant, the same without x.grad/w.grad accumulation
    (grads reset to None each step: AccumulateGrad steals the gradient instead of adding a kernel)."""
    import torch
    import torch.nn.functional as F

    import kspec

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(4, 256, device=dev, dtype=bf, requires_grad=True)
    w = torch.ones(256, device=dev, dtype=bf, requires_grad=True)
    gy = torch.randn(4, 256, device=dev, dtype=bf)
    variants = [("torch F.rms_norm", None, lambda: F.rms_norm(x, (256,), w, 1e-5)),
                ("kspec ext (call_grad)", None, lambda: kspec.ops.norm_act(x, w, None, norm="rmsnorm")),
                ("kspec node (record)", "node", lambda: kspec.ops.norm_act(x, w, None, norm="rmsnorm"))]
    clock = time.perf_counter_ns
    res = {name: {"fwd": [], "bwd": [], "wall": []} for name, _, _ in variants}

    def run_steps(name, path, fn, n, reset):
        ctx = _PATHS[path]() if path else None
        if ctx:
            ctx.__enter__()
        try:
            fwd, bwd = res[name]["fwd"], res[name]["bwd"]
            torch.cuda.synchronize()
            t_start = clock()
            for _ in range(n):
                if reset:
                    x.grad = w.grad = None
                t0 = clock()
                y = fn()
                t1 = clock()
                y.backward(gy)
                t2 = clock()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            torch.cuda.synchronize()
            res[name]["wall"].append((clock() - t_start) / n)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)

    for name, path, fn in variants:  # warm-up (compiles, allocator pools)
        run_steps(name, path, fn, 20, False)
        for k in res[name]:
            res[name][k].clear()
    for _ in range(rounds):
        for name, path, fn in variants:
            run_steps(name, path, fn, steps, False)
    rows = []
    med = lambda v: sorted(v)[len(v) // 2] / 1e3  # noqa: E731
    for name, path, fn in variants:
        r = {"variant": name, "fwd_us": med(res[name]["fwd"]), "bwd_us": med(res[name]["bwd"]),
             "wall_us": med(res[name]["wall"])}
        # the same without accumulation into x.grad / w.grad (one add kernel each per step)
        res[name] = {"fwd": [], "bwd": [], "wall": []}
        run_steps(name, path, fn, steps, True)
        r["wall_no_accum_us"] = med(res[name]["wall"])
        r["bwd_no_accum_us"] = med(res[name]["bwd"])
        try:
            from torch.profiler import ProfilerActivity, profile

            ctx = _PATHS[path]() if path else None
            if ctx:
                ctx.__enter__()
            try:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        fn().backward(gy)
                    torch.cuda.synchronize()
            finally:
                if ctx:
                    ctx.__exit__(None, None, None)
            ev = prof.key_averages()
            r["launches_per_step"] = sum(e.count for e in ev if e.key in ("cuLaunchKernel", "cudaLaunchKernel",
                                                                         "cuLaunchKernelEx", "cudaLaunchKernelExC")) / 20
            r["gpu_ops_per_step"] = sum(e.count for e in ev if str(e.device_type).endswith("CUDA")) / 20
            if trace:
                r["trace"] = ev.table(sort_by="self_cpu_time_total", row_limit=14)
        except Exception as e:  # noqa: BLE001  (the timings stand without the profiler)
            r["trace_error"] = str(e)[:200]
        rows.append(r)
    return rows


def cpp_rows(path):
    """kspec_dispatch_bench's JSON (C++: raw cuLaunchKernel, kspec::call, the typed wrapper, a BoundCall, a gemm)."""
    r = subprocess.run([path], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{path} exited {r.returncode}: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout)


def run(args) -> dict:
    import torch

    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS, "warmup": WARMUP,
            "rows": [], "steps": []}
    print(f"dispatch: median host µs of {CALLS} calls after {WARMUP} warm-ups ({data['device']}, torch {torch.__version__})")
    from kspec import _native

    data["torch_ext"] = _native.ext is not None
    print("torch extension (kspec._torch_ext): " + ("loaded; each kspec row twice, path ext and pure"
                                                     if data["torch_ext"] else "not loaded (pure path)"))
    print(f"{'group':8} {'call':50} {'path':5} {'µs':>8}")
    for group, name, path, fn in _twins(call_rows() + piece_rows() + native_rows()):
        if fn is None:
            us = None
        elif path in _PATHS:
            with _PATHS[path]():
                us = host_us(fn)
        else:
            us = host_us(fn)
        row = {"group": group, "call": name, "path": path, "us": us}
        # where the GPU may be the slower side (mhc.pre at decode streams its whole projection per call)
        gpu = gpu_us(fn) if group == "mhc" and fn is not None and path != "pure" else None
        row["gpu_us"] = gpu
        data["rows"].append(row)
        print(f"{group:8} {name:50} {path:5} {'n/a' if us is None else f'{us:8.1f}':>8}"
              + ("" if gpu is None else f"   gpu {gpu:7.1f}"))
    print(f"\ntraining steps, each group's variants interleaved ({ROUNDS} rounds of {ROUND_STEPS} steps; medians over "
          "rounds; x peer: the median of the rounds' wall ratios to the group's first row)")
    print(f"{'group':10} {'step':42} {'path':5} {'wall µs':>9} {'host µs':>9} {'x peer':>7}")
    groups: dict = {}
    for group, name, path, fn in _twins(step_rows()):
        groups.setdefault(group, []).append((name, path, fn))
    for group, rows in groups.items():
        timed = [(name, path, fn) for name, path, fn in rows if fn is not None]
        results = dict(zip(((n, p) for n, p, _ in timed), interleaved_steps([(fn, path) for _, path, fn in timed])))
        for name, path, fn in rows:
            wall, host, ratio = results.get((name, path), (None, None, None))
            if rows[0][2] is None:  # no peer installed: the first timed row is no peer
                ratio = None
            data["steps"].append({"group": group, "step": name, "path": path, "wall_us": wall, "host_us": host,
                                  "x_peer": ratio})
            cols = ("      n/a       n/a     n/a" if wall is None else
                    f"{wall:9.1f} {host:9.1f} " + ("    n/a" if ratio is None else f"{ratio:7.3f}"))
            print(f"{group:10} {name:42} {path:5} {cols}")
    if getattr(args, "trace", False):
        print("\nnorm_act [4, 256] bf16 training step, variants interleaved (host µs per call: fwd, bwd; wall µs per "
              "step with x.grad/w.grad accumulated, and with them reset to None)")
        print(f"{'variant':24} {'fwd':>7} {'bwd':>7} {'wall':>8} {'bwd*':>7} {'wall*':>8} {'launches':>9} {'gpu ops':>8}")
        data["norm_step_breakdown"] = norm_step_breakdown(True)
        for r in data["norm_step_breakdown"]:
            print(f"{r['variant']:24} {r['fwd_us']:7.1f} {r['bwd_us']:7.1f} {r['wall_us']:8.1f} "
                  f"{r['bwd_no_accum_us']:7.1f} {r['wall_no_accum_us']:8.1f} {r.get('launches_per_step', float('nan')):9.1f} "
                  f"{r.get('gpu_ops_per_step', float('nan')):8.1f}")
        for r in data["norm_step_breakdown"]:
            if r.get("trace"):
                print(f"\n{r['variant']}: torch.profiler, 20 steps, by self CPU\n{r['trace']}")
            elif r.get("trace_error"):
                print(f"{r['variant']}: profiler: {r['trace_error']}")
    if getattr(args, "dispatch_bin", None):
        try:
            c = cpp_rows(args.dispatch_bin)
            data["cpp"] = c
            print(f"\nC++ ({c['problem']}; {c['reps']} rounds of {c['launches_per_rep']} calls, methods in turn; "
                  "+x: the median over rounds of the round's difference from raw, p90 in brackets): raw cuLaunchKernel "
                  f"{c['raw_us']:.2f} µs, kspec::call {c['call_us']:.2f} (+{c['call_minus_raw_us']:.2f} "
                  f"[{c['call_minus_raw_p90_us']:.2f}]), prebuilt params {c['call_prebuilt_params_us']:.2f} "
                  f"(+{c['call_prebuilt_params_minus_raw_us']:.2f} [{c['call_prebuilt_params_minus_raw_p90_us']:.2f}]), "
                  f"typed {c['typed_us']:.2f} (+{c['typed_minus_raw_us']:.2f}), BoundCall {c['bound_us']:.2f} "
                  f"(+{c['bound_minus_raw_us']:.2f} [{c['bound_minus_raw_p90_us']:.2f}]); "
                  f"kspec::call gemm ({c['gemm_problem']}, one cuBLASLt matmul) {c['gemm_us']:.2f}")
            print("C++ breakdown (µs; +x over raw as above): " + ", ".join(
                f"{m} {c[m + '_us']:.2f}" + ("" if m == "raw" else f" (+{c[m + '_minus_raw_us']:.2f} "
                                                                f"[{c[m + '_minus_raw_p90_us']:.2f}])")
                for m in c.get("methods", [])))
        except Exception as e:  # the Python table stands without it
            data["cpp_error"] = str(e)
            print(f"\nC++ dispatch benchmark: {e}")
    return data


# ---- mhc.pre at the decode shape: the split plan (the heuristic's today) against algo=decode, one process ----

DECODE_CONFIG = "algo=4,threads=256,tokens=1"
DECODE_ROWS_CONFIG = "algo=5,threads=256,tokens=1"  # the projection's warps split phi's rows (the same bits)


def _own_tuning_db() -> str:
    """A tuning database of this process's own (KSPEC_TUNING_DB: a file in a temporary folder, not there yet), so
    that the machine's is neither read nor written. Returns the folder."""
    import os
    import tempfile

    folder = tempfile.mkdtemp(prefix="kspec-mhc-decode-")
    os.environ["KSPEC_TUNING_DB"] = os.path.join(folder, "db.json")
    return folder


def _decode_tuned(folder, calls, config=DECODE_CONFIG, time_ms=1e-3) -> None:
    """Routes the calls' problems to `config`: one record per problem (its key from kspec.explain) imported into
    the process's own database (_own_tuning_db; a smaller time_ms replaces a record), which makes dispatch choose
    their configs again."""
    import os

    import kspec
    from kspec import tuning

    entries = {kspec.explain(op, *inputs, **params).tuning_key: {"config": config, "time_ms": time_ms}
               for op, inputs, params in calls}
    src = os.path.join(folder, "decode.json")
    with open(src, "w") as f:
        json.dump({"version": 1, "kind": "kspec-tuning", "entries": entries}, f)
    tuning.import_db(src)


def mhc_decode(args) -> dict:
    """Issue 34's decode shape (T 8, n 4, D 4096, bf16): host µs per call (dispatch's loop) and GPU µs (the kernels
    alone, queued behind a spin kernel) of kspec.ops.mhc_pre, without and with a gradient, on the heuristic's plan
    (mma_ring: the split plan, two launches) and on algo=decode (one launch), beside torch's F.rms_norm over the
    same x; each algo's outputs checked against the other's first. The decode rows go through dispatch's fast path:
    a tuning database of the process's own records algo=decode for these problems (_decode_tuned)."""
    import torch
    import torch.nn.functional as F

    import kspec

    folder = _own_tuning_db()
    dev, bf = "cuda", torch.bfloat16
    T, n, D = 8, 4, 4096
    M = n * n + 2 * n
    torch.manual_seed(34)
    x = torch.randn(T, n, D, device=dev, dtype=bf)
    phi = torch.randn(M, n * D, device=dev) / (n * D) ** 0.5
    alpha, bias = torch.tensor([0.7, -0.5, 1.3], device=dev), torch.randn(M, device=dev) * 0.5
    gamma = 1 + 0.3 * torch.randn(n * D, device=dev)
    xg = x.clone().requires_grad_()
    xf, w = x.view(T, n * D), torch.ones(n * D, device=dev, dtype=bf)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    pre = no_grad(lambda: kspec.ops.mhc_pre(x, phi, alpha, bias, gamma))
    pre_grad = lambda: kspec.ops.mhc_pre(xg, phi, alpha, bias, gamma)  # noqa: E731
    rows = [("torch F.rms_norm [8, 16384] bf16 (no grad)", no_grad(lambda: F.rms_norm(xf, (n * D,), w, 1e-6)))]
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS, "rows": []}
    print(f"mhc.pre decode (T {T}, n {n}, D {D}, bf16): median host µs of {CALLS} calls, GPU µs of the kernels "
          f"({data['device']}, torch {torch.__version__})")
    print(f"{'call':58} {'host µs':>8} {'gpu µs':>8}")

    def timed(name, fn):
        us, gpu = host_us(fn), gpu_us(fn)
        data["rows"].append({"call": name, "us": us, "gpu_us": gpu})
        print(f"{name:58} {us:8.1f} {gpu:8.1f}")

    for name, fn in rows:
        timed(name, fn)
    before = [t.clone() for t in pre()]
    algo = kspec.explain("mhc.pre.fwd", x, phi, alpha, bias, gamma, save_stats=False).config
    timed(f"kspec.ops.mhc_pre (no grad), heuristic: {algo}", pre)
    timed("torch F.rms_norm (input requires grad)", lambda: F.rms_norm(xg.view(T, n * D), (n * D,), w, 1e-6))
    timed("kspec.ops.mhc_pre (input requires grad), heuristic", pre_grad)
    problems = [("mhc.pre.fwd", (x, phi, alpha, bias, gamma), {"save_stats": False}),
                ("mhc.pre.fwd", (x, phi, alpha, bias, gamma), {})]
    decoded = None
    for config, time_ms in ((DECODE_CONFIG, 1e-3), (DECODE_ROWS_CONFIG, 1e-4)):
        _decode_tuned(folder, problems, config, time_ms)
        algo = kspec.explain("mhc.pre.fwd", x, phi, alpha, bias, gamma, save_stats=False).config
        if algo != config:
            raise RuntimeError(f"the decode rows would run {algo}, not {config}")
        after = pre()
        for name, a, b in zip(("y", "h_pre", "h_post", "r"), before, after):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            data.setdefault(f"max_rel_split_vs_{config}", {})[name] = err
            print(f"  {name}: max |split - {config}| / max |it| = {err:.2e}")
        if decoded is not None:
            data[f"same_bits_as_{DECODE_CONFIG}"] = all(torch.equal(a, b) for a, b in zip(decoded, after))
            print(f"  the same bits as {DECODE_CONFIG}: {data[f'same_bits_as_{DECODE_CONFIG}']}")
        decoded = [o.clone() for o in after]
        timed(f"kspec.ops.mhc_pre (no grad), {algo}", pre)
        timed(f"kspec.ops.mhc_pre (input requires grad), {algo}", pre_grad)
    # Where decode stops paying: GPU µs of each plan by T (kspec.call with the config named; the host path's cost
    # does not enter a GPU time), for api/ops/mhc/op.cpp's kDecodeUpToT.
    print(f"\n{'T':>5} {'split plan gpu µs':>18} {'decode gpu µs':>14} {'decode_rows gpu µs':>19}")
    data["by_T"] = []
    for tt in (1, 8, 16, 32, 64, 128, 256):
        xt = torch.randn(tt, n, D, device=dev, dtype=bf)
        gpu = [gpu_us(no_grad(lambda c=c: kspec.call("mhc.pre.fwd", xt, phi, alpha, bias, gamma, config=c,
                                                          save_stats=False)))
               for c in ("algo=3,threads=128,tokens=32", DECODE_CONFIG, DECODE_ROWS_CONFIG)]
        data["by_T"].append({"T": tt, "split_gpu_us": gpu[0], "decode_gpu_us": gpu[1], "decode_rows_gpu_us": gpu[2]})
        print(f"{tt:5d} {gpu[0]:18.1f} {gpu[1]:14.1f} {gpu[2]:19.1f}")
    return data


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dispatch-bin", metavar="PATH", help="the kspec_dispatch_bench binary (C++ rows)")
    p.add_argument("--trace", action="store_true", help="the norm step's breakdown (fwd/bwd host µs, with and without "
                   "gradient accumulation, kernels per step) and torch.profiler's rows of each variant")
    p.add_argument("--mhc-decode", action="store_true", help="only mhc.pre at the decode shape: the split plan "
                   "against algo=decode (host and GPU µs, one process; under a minute)")
    args = p.parse_args()
    data = mhc_decode(args) if args.mhc_decode else run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
