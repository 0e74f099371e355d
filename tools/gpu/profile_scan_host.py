"""Where the host time of a selective_scan training step goes (kspec.ops.selective_scan_fn forward +
backward through autograd), at one or more shapes in one process: per-piece host microseconds
(perf_counter_ns around the raw calls, the autograd forward, the backward), the step timed as
tools/bench/timing.py's "ev" column (after a synchronize and an L2 flush) split at the forward's return
(GPU events and host clock side by side: whether the step's ev is the host's or the GPU's), torch's
caching-allocator counters per step (cudaMalloc / cudaFree / retries: what the mock driver of
tests/mock_cuda cannot see), and a profile of the loop. A diagnosis tool for the GPU machine.

    python3 tools/gpu/profile_scan_host.py --shape 1x2048x512,16x768x256,2x4096x333 [--json F] [--trace] [--split]

--trace adds torch.profiler's table of the CUDA API calls and kernels of 5 ev-style steps per shape. --split
times the ev step's backward in pieces on the host clock, from hooks in kspec's and mamba_ssm's backward (what
torch's autograd engine takes before and after the op's own backward, against the op's), and the ev step early
and late in its run (a warm-up drift shows as a difference). A shape may be given twice: the rows of its first
run and of its last then show what the order of the shapes does.

--torch-profile (instead of the rows above): torch.profiler over 20 fwd+bwd steps of kspec's selective_scan_fn and of
the no-op C++ node (kspec._torch_ext.noop_grad: the step's floor without kspec), per shape: the host µs a step, the
kernels' GPU µs a step, each op's / function's self CPU µs a step (the top 25) and the CUDA runtime and driver calls
a step (launches, memsets, synchronizes, copies, allocations): what of the ev step above the C++ floor is kspec's.

--probe (instead of the rows above) asks why the host's CUDA calls of a step cost twice as much at 1x2048x512
as at the other shapes (run 21: the forward 116-129 us, the backward's call 102-137, torch's hop and tail too):
one call's host us (medians) of a raw cuLaunchKernel of an empty kernel, the raw kspec.call forward and
backward (outputs given: no allocation) and controls without a CUDA call, each right after a synchronize, after
the GPU has been idle 0.2 / 2 ms (the host spinning, or sleeping: a host or a GPU idle effect), behind a busy
GPU (a 1 ms spin kernel queued) and back to back; then the fwd+bwd step of a no-op autograd.Function with the
scan's 8 inputs (it allocates its output and 8 gradients, launches nothing) timed as the ev step: torch's
engine alone, the floor under both libraries' steps."""
import argparse
import cProfile
import ctypes
import dataclasses
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

import kspec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from scan_floor import NoopScan  # noqa: E402  (the floor, shared with the bench's selective_scan fwd+bwd rows)


def per_call_us(fn, calls=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        t.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    t.sort()
    return t[len(t) // 2]


def ev_split(fwd, bwd, flush, reps=100):
    """The step as the bench's ev column times it (synchronize, flush, events around one call), split at the
    forward's return: GPU ms from the start event to an event recorded after the forward / to the end, and
    the host's µs to the same two points. host ≈ GPU for a part: the host's enqueueing is that part's time."""
    ev = torch.cuda.Event
    rows = {"ev_fwd_ms": [], "ev_step_ms": [], "host_fwd_us": [], "host_step_us": []}
    for _ in range(reps + 10):
        flush()
        torch.cuda.synchronize()
        s, m, e = ev(enable_timing=True), ev(enable_timing=True), ev(enable_timing=True)
        s.record()
        t0 = time.perf_counter_ns()
        y = fwd()
        t1 = time.perf_counter_ns()
        m.record()
        bwd(y)
        t2 = time.perf_counter_ns()
        e.record()
        e.synchronize()
        for k, v in (("ev_fwd_ms", s.elapsed_time(m)), ("ev_step_ms", s.elapsed_time(e)),
                     ("host_fwd_us", (t1 - t0) / 1e3), ("host_step_us", (t2 - t0) / 1e3)):
            rows[k].append(v)
    out = {k: statistics.median(v[10:]) for k, v in rows.items()}
    step = sorted(rows["ev_step_ms"][10:])
    out["ev_step_min_ms"], out["ev_step_p90_ms"] = step[0], step[int(0.9 * (len(step) - 1))]
    return out


ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_per_step(step, steps=50):
    """torch's caching-allocator events per step (each device alloc/free is a cudaMalloc/cudaFree; a free
    waits for the device)."""
    step()
    torch.cuda.synchronize()
    a = torch.cuda.memory_stats()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    b = torch.cuda.memory_stats()
    return {k: (b.get(k, 0) - a.get(k, 0)) / steps for k in ALLOCATOR_COUNTERS}


class BackwardClock:
    """Host timestamps (perf_counter_ns, one clock for every thread) inside one backward: the op's node
    entered and left (it runs on autograd's device thread), and the op's own call inside it (kspec: its
    registry call of selective_scan.bwd). Installed by wrapping the Python functions the node runs."""

    def __init__(self):
        self.marks = {}
        self.calls = 0

    def mark(self, name):
        self.marks[name] = time.perf_counter_ns()

    def wrap(self, fn, enter, leave):
        def wrapped(*args, **kwargs):
            self.mark(enter)
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(leave)
                self.calls += 1
        return wrapped


def kspec_clock():
    """Hooks in kspec's selective_scan backward on the torch extension's record path (SurfaceBackward calls
    the surface's _native_backward, which calls the family's backward: the registry call). The default path,
    call_grad's C++ node, runs no Python to hook: while the clock is on, the scan takes the record path
    (grad_call off), so --split times that path's pieces, not the default's. None without the extension (the
    autograd.Function's backward is bound at import)."""
    from kspec import _native, _torch

    surf = _torch.selective_scan
    if _native.ext is None:
        return None, lambda: None
    clock = BackwardClock()
    family, native, grad_call = surf.family, surf._native_backward, surf.grad_call
    surf.family = dataclasses.replace(family, backward=clock.wrap(family.backward, "call", "call_end"))
    surf._native_backward = clock.wrap(native, "node", "node_end")
    surf.grad_call = None

    def undo():
        surf.family = family
        surf.grad_call = grad_call
        del surf._native_backward
    return clock, undo


def mamba_clock():
    """mamba_ssm's SelectiveScanFn.backward (Python, on the device thread) with the node's entry and exit;
    its C++ call is the rest of it (no separate marks)."""
    from mamba_ssm.ops import selective_scan_interface as m

    clock = BackwardClock()
    raw = m.SelectiveScanFn.__dict__["backward"]
    fn = clock.wrap(raw.__func__ if isinstance(raw, staticmethod) else raw, "node", "node_end")
    m.SelectiveScanFn.backward = staticmethod(lambda ctx, *a: fn(ctx, *a))

    def undo():
        m.SelectiveScanFn.backward = raw
    return clock, undo


def split_step(fwd, bwd, flush, clock, reps=100):
    """The ev step (as ev_split) with the host's pieces (µs, medians): fwd (the forward's return), hop (from
    backward() to the node's entry on the device thread: torch's engine, a thread wake-up), pre (the node's
    Python before the op's call), call (the op's call: allocations, launches), post (after it, in the node),
    tail (from the node's exit to backward()'s return on the calling thread: the AccumulateGrad nodes, the
    engine's completion, a wake-up), and the ev step in the first and last 30 timed steps."""
    ev = torch.cuda.Event
    pieces = {k: [] for k in ("fwd", "hop", "pre", "call", "post", "tail", "host_step")}
    steps = []
    for i in range(reps + 10):
        flush()
        torch.cuda.synchronize()
        clock.marks.clear()
        s, e = ev(enable_timing=True), ev(enable_timing=True)
        s.record()
        t0 = time.perf_counter_ns()
        y = fwd()
        t1 = time.perf_counter_ns()
        bwd(y)
        t2 = time.perf_counter_ns()
        e.record()
        e.synchronize()
        if i < 10:
            continue
        m = clock.marks
        steps.append(s.elapsed_time(e))
        pieces["fwd"].append(t1 - t0)
        pieces["host_step"].append(t2 - t0)
        if "node" in m and "node_end" in m:
            pieces["hop"].append(m["node"] - t1)
            pieces["tail"].append(t2 - m["node_end"])
            if "call" in m and "call_end" in m:
                pieces["pre"].append(m["call"] - m["node"])
                pieces["call"].append(m["call_end"] - m["call"])
                pieces["post"].append(m["node_end"] - m["call_end"])
    out = {f"split_{k}_us": statistics.median(v) / 1e3 for k, v in pieces.items() if v}
    out["split_ev_step_ms"] = statistics.median(steps)
    out["split_ev_first30_ms"] = statistics.median(steps[:30])
    out["split_ev_last30_ms"] = statistics.median(steps[-30:])
    return out


def scan_inputs(b, d, t, dev, n=16):
    """The Mamba-1 call's inputs (bf16 u, delta, z and variable B/C of one group; fp32 A, D, delta_bias)."""
    bf = torch.bfloat16
    return dict(u=torch.randn(b, d, t, device=dev, dtype=bf), delta=torch.randn(b, d, t, device=dev, dtype=bf) * 0.5 - 1,
                A=-(0.25 + torch.rand(d, n, device=dev)), B=torch.randn(b, 1, n, t, device=dev, dtype=bf),
                C=torch.randn(b, 1, n, t, device=dev, dtype=bf), D=torch.randn(d, device=dev),
                z=torch.randn(b, d, t, device=dev, dtype=bf), delta_bias=torch.randn(d, device=dev) * 0.1)


def profile_shape(shape, trace, split=False, cprofile=True, label=None):
    b, d, t = (int(v) for v in shape.split("x"))
    n = 16
    dev = "cuda"
    x = scan_inputs(b, d, t, dev, n)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    dout = torch.randn_like(x["u"])
    args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    largs = [leaves[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    out = torch.empty_like(x["u"])
    last = torch.empty(b, d, n, device=dev)
    states = torch.empty(b, d, -(-t // 16), n, device=dev)
    flush_buf = torch.empty(64 << 20, dtype=torch.int32, device=dev)  # 256 MiB, as the bench's timer
    r = {}
    r["raw_fwd_out"] = per_call_us(lambda: kspec.call("selective_scan.fwd", *args, None, delta_softplus=True,
                                                      out=(out, last, states)))
    r["raw_fwd_alloc"] = per_call_us(lambda: kspec.call("selective_scan.fwd", *args, None, delta_softplus=True))
    r["raw_bwd_alloc"] = per_call_us(lambda: kspec.call("selective_scan.bwd", dout, *args, None, None, states,
                                                        delta_softplus=True))
    r["fn_nograd"] = per_call_us(lambda: kspec.ops.selective_scan_fn(*args, delta_softplus=True))
    r["fn_grad_fwd"] = per_call_us(lambda: kspec.ops.selective_scan_fn(*largs, delta_softplus=True))

    def fwd(fn=kspec.ops.selective_scan_fn):
        for v in leaves.values():
            v.grad = None
        return fn(*largs, delta_softplus=True)

    def step(fn=kspec.ops.selective_scan_fn):
        fwd(fn).backward(dout)

    r["fwdbwd_step"] = per_call_us(step, 100)
    r.update({f"kspec_{k}": v for k, v in ev_split(fwd, lambda y: y.backward(dout), flush_buf.zero_).items()})
    gc.disable()  # Python's collector runs every few hundred allocations: whether it is in the ev median
    try:
        r["kspec_ev_step_gc_off_ms"] = ev_split(fwd, lambda y: y.backward(dout), flush_buf.zero_)["ev_step_ms"]
    finally:
        gc.enable()
    r.update({f"kspec_{k}": v for k, v in allocator_per_step(step).items()})
    if split:
        clock, undo = kspec_clock()
        if clock is None:
            r["kspec_split"] = "no torch extension: the backward's hooks are not on this path"
        else:
            try:
                r.update({f"kspec_{k}": v for k, v in split_step(fwd, lambda y: y.backward(dout), flush_buf.zero_,
                                                                 clock).items()})
            finally:
                undo()
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as peer

        r["mamba_fwdbwd_step"] = per_call_us(lambda: step(peer), 100)
        r["mamba_fwd_nograd"] = per_call_us(lambda: peer(*args, delta_softplus=True))
        r.update({f"mamba_{k}": v for k, v in ev_split(lambda: fwd(peer), lambda y: y.backward(dout),
                                                         flush_buf.zero_).items()})
        if split:
            clock, undo = mamba_clock()
            try:
                r.update({f"mamba_{k}": v for k, v in split_step(lambda: fwd(peer), lambda y: y.backward(dout),
                                                                 flush_buf.zero_, clock).items()})
            finally:
                undo()
    except Exception as e:  # noqa: BLE001
        r["mamba"] = str(e)[:200]
    for k, v in r.items():
        unit = "ms" if k.endswith("_ms") else "per step" if k.split("_", 1)[-1] in ALLOCATOR_COUNTERS else "us"
        print(f"{label or shape} {k:>30}: {v if isinstance(v, str) else f'{v:9.3f} {unit}'}", flush=True)
    if cprofile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue())
    if trace:
        from torch.profiler import ProfilerActivity, profile

        try:  # CUPTI may be missing: the rows above stand without the table
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ev_split(fwd, lambda y: y.backward(dout), flush_buf.zero_, reps=5)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        except Exception as e:  # noqa: BLE001
            print(f"{shape} trace: {str(e)[:200]}")
    del flush_buf
    torch.cuda.empty_cache()
    return r


# ---- --probe: one CUDA call's host cost by the state of the GPU and of the host ----

_NOOP_PTX = b""".version 7.0
.target sm_80
.address_size 64
.visible .entry kspec_probe_noop() { ret; }
"""


class RawLaunch:
    """cuLaunchKernel of an empty kernel (1 block of 32 threads) on torch's current stream, through ctypes
    (the same ctypes call to cuCtxGetCurrent is the control: what ctypes itself costs)."""

    def __init__(self, libcuda="libcuda.so.1"):
        cu = ctypes.CDLL(libcuda)
        torch.cuda.current_stream().synchronize()  # torch's primary context is current on this thread
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        for rc in (cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(_NOOP_PTX)),
                   cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"kspec_probe_noop")):
            if rc != 0:
                raise RuntimeError(f"probe: driver error {rc} loading the empty kernel")
        self.cu, self.fn, self.ctx = cu, fn, ctypes.c_void_p()
        self.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def launch(self):
        self.cu.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, self.stream, None, None)

    def ctypes_only(self):
        self.cu.cuCtxGetCurrent(ctypes.byref(self.ctx))


def _spin_us(us):
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


# The state of the GPU and the host before each timed call: the queue is empty except in "gpu busy" (a ~1 ms
# spin kernel queued first) and "back to back" (the previous call's work).
PROBE_STATES = {
    "after sync": lambda: torch.cuda.synchronize(),
    "gpu idle 0.2 ms, host spins": lambda: (torch.cuda.synchronize(), _spin_us(200)),
    "gpu idle 2 ms, host spins": lambda: (torch.cuda.synchronize(), _spin_us(2000)),
    "gpu idle 2 ms, host sleeps": lambda: (torch.cuda.synchronize(), time.sleep(0.002)),
    "gpu busy": lambda: (torch.cuda.synchronize(), torch.cuda._sleep(2_000_000)),
    "gpu busy, host sleeps 0.2 ms": lambda: (torch.cuda.synchronize(), torch.cuda._sleep(2_000_000), time.sleep(0.0002)),
    "back to back": None,
}


def probe_call_us(fn, before, reps=40):
    """Median host us of one fn() after before() (not timed); back to back: fn() after fn(), no wait."""
    t = []
    for i in range(reps + 5):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        if i >= 5:
            t.append((t1 - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(t)


def probe_shape(shape, dev="cuda", libcuda="libcuda.so.1", flush_words=64 << 20):
    """The probe's rows at one shape (see --probe in the module's docstring). dev, libcuda, flush_words: for
    its test on the mock driver (CPU tensors)."""
    b, d, t = (int(v) for v in shape.split("x"))
    n, bf = 16, torch.bfloat16
    x = scan_inputs(b, d, t, dev, n)
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    args = [x[k] for k in names]
    leaves = [x[k].clone().requires_grad_() for k in names]
    dout = torch.randn_like(x["u"])
    fwd_out = (torch.empty_like(x["u"]), torch.empty(b, d, n, device=dev), torch.empty(b, d, -(-t // 16), n, device=dev))
    kspec.call("selective_scan.fwd", *args, None, delta_softplus=True, out=fwd_out)
    bwd_in = (dout, *args, None, None, fwd_out[2])
    bwd_out = kspec.call("selective_scan.bwd", *bwd_in, delta_softplus=True)
    raw = RawLaunch(libcuda)
    small = torch.empty(1024, device=dev)
    calls = {
        "python no-op": lambda: None,
        "ctypes cuCtxGetCurrent": raw.ctypes_only,
        "torch.empty like u (no CUDA call)": lambda: torch.empty(b, d, t, device=dev, dtype=bf),
        "raw cuLaunchKernel, empty kernel": raw.launch,
        "torch zero_ of 4 KB (1 launch)": small.zero_,
        "kspec.call fwd, out given": lambda: kspec.call("selective_scan.fwd", *args, None, delta_softplus=True,
                                                        out=fwd_out),
        "kspec.call bwd, out given": lambda: kspec.call("selective_scan.bwd", *bwd_in, delta_softplus=True,
                                                        out=bwd_out),
    }
    print(f"{shape} probe: host us of one call (median of 40) | " + " | ".join(PROBE_STATES), flush=True)
    for name, fn in calls.items():
        row = " | ".join(f"{probe_call_us(fn, before):7.1f}" for before in PROBE_STATES.values())
        print(f"{shape} probe {name:>34} | {row}", flush=True)
    # torch's engine alone (NoopScan) beside kspec's and mamba_ssm's steps, each timed as the ev step
    flush_buf = torch.empty(flush_words, dtype=torch.int32, device=dev)  # 256 MiB, as the bench's timer

    def fwd(fn):
        for v in leaves:
            v.grad = None
        return fn()
    steps = {"no-op autograd.Function (engine alone)": lambda: NoopScan.apply(*leaves),
             "kspec selective_scan_fn": lambda: kspec.ops.selective_scan_fn(*leaves, delta_softplus=True)}
    from kspec import _native

    noop_cpp = getattr(_native.ext, "noop_grad", None)  # the same through a C++ node, as kspec's is
    if noop_cpp is not None:
        steps["no-op C++ node (engine alone)"] = lambda: noop_cpp(tuple(leaves))
    try:
        if dev != "cuda":  # the mock driver's CPU tensors: mamba_ssm's kernels take CUDA tensors only
            raise RuntimeError("not on a CUDA device")
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as peer
        steps["mamba_ssm selective_scan_fn"] = lambda: peer(*leaves, delta_softplus=True)
    except Exception as e:  # noqa: BLE001
        print(f"{shape} probe mamba_ssm: {str(e)[:120]}")
    for name, fn in steps.items():
        r = ev_split(lambda fn=fn: fwd(fn), lambda y: y.backward(dout), flush_buf.zero_)
        loop = per_call_us(lambda fn=fn: fwd(fn).backward(dout), 100)
        idle, busy = (probe_call_us(lambda fn=fn: fwd(fn).backward(dout), PROBE_STATES[st])
                      for st in ("after sync", "gpu busy"))
        print(f"{shape} probe step {name:>38}: ev {r['ev_step_ms'] * 1e3:6.1f} us (min {r['ev_step_min_ms'] * 1e3:6.1f}), "
              f"host fwd {r['host_fwd_us']:6.1f}, host step {r['host_step_us']:6.1f}, back-to-back loop {loop:6.1f}; "
              f"host step after a sync {idle:6.1f}, behind a busy GPU {busy:6.1f}", flush=True)
    del flush_buf
    torch.cuda.empty_cache()


def torch_profile_shape(shape, steps=20, dev="cuda"):
    """--torch-profile: kspec's fwd+bwd step and the no-op C++ node's under torch.profiler (see the module doc). dev:
    "cpu" for its test on the mock driver (the CPU activity alone)."""
    from kspec import _native
    from torch.profiler import ProfilerActivity, profile

    b, d, t = (int(v) for v in shape.split("x"))
    x = scan_inputs(b, d, t, dev)
    leaves = [x[k].clone().requires_grad_() for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    dout = torch.randn_like(x["u"])
    impls = {"kspec selective_scan_fn": lambda: kspec.ops.selective_scan_fn(*leaves, delta_softplus=True)}
    noop = getattr(_native.ext, "noop_grad", None)
    if noop is not None:
        impls["no-op C++ node"] = lambda: noop(tuple(leaves))

    def step(fn):
        for v in leaves:
            v.grad = None
        fn().backward(dout)
    api = ("cuda", "cu")  # runtime and driver calls: cudaLaunchKernel, cuLaunchKernel(Ex), cudaMemsetAsync, ...
    for name, fn in impls.items():
        for _ in range(5):
            step(fn)
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter_ns()
            for _ in range(steps):
                step(fn)
            host_us = (time.perf_counter_ns() - t0) / 1e3 / steps
            sync()
        events = prof.key_averages()
        gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events
                     if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA) / steps
        print(f"{shape} torch-profile {name}: host {host_us:.1f} us a step (under the profiler), kernels {gpu_us:.1f} "
              f"GPU us a step", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        calls = sorted((e for e in events if e.key.startswith(api)), key=lambda e: -e.self_cpu_time_total)
        print(f"{shape} torch-profile {name}: CUDA runtime / driver calls a step (count, self CPU us)")
        for e in calls:
            print(f"{shape}   {e.key:40s} {e.count / steps:6.2f} {e.self_cpu_time_total / steps:8.2f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="2x4096x333", help="BxDxL, or several separated by commas")
    p.add_argument("--json")
    p.add_argument("--trace", action="store_true", help="torch.profiler's CUDA API and kernel table per shape")
    p.add_argument("--split", action="store_true", help="the ev step's backward in host pieces (hooks), early/late")
    p.add_argument("--no-profile", action="store_true", help="leave out the cProfile table")
    p.add_argument("--probe", action="store_true",
                   help="only the probe: one CUDA call's host us by GPU/host state, and torch's engine alone")
    p.add_argument("--torch-profile", action="store_true",
                   help="only torch.profiler over 20 fwd+bwd steps of kspec and of the no-op C++ node")
    a = p.parse_args()
    shapes = a.shape.split(",")
    if a.torch_profile:
        for shape in shapes:
            torch_profile_shape(shape)
        return
    if a.probe:
        for shape in shapes:
            probe_shape(shape)
        return
    results = {}
    for i, shape in enumerate(shapes):  # a repeated shape keeps each run's rows apart: shape#run
        key = shape if shapes.count(shape) == 1 else f"{shape}#{shapes[:i + 1].count(shape)}"
        results[key] = profile_shape(shape, a.trace, a.split, not a.no_profile, key)
    if a.json:
        json.dump(results if len(results) > 1 else next(iter(results.values())), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
