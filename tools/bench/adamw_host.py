#!/usr/bin/env python3
"""Host time of kspec.optim.AdamW.step() without a GPU: everything that runs before the driver is asked
for anything, on GPT-350M's 243 parameter tensors (354.8 M parameters, fp32) held in host memory.

  PYTHONPATH=<kspec install>:<torch> python3 tools/bench/adamw_host.py [--steps 30] [--before REV]

Two parts, measured separately because validation stops at host tensors:
- Python: optimizer.step() with kspec's native entry points stubbed out (kspec._core._C.call for the
  per-step path; kspec.optim._C.BoundCall.run for the bound path), the stream query stubbed: the
  optimizer's own loops, state checks, descriptors and the cache key.
- C++: _C.call("adamw", ...) on the same descriptors with their device set to cuda:0 — the tuples'
  conversion to views, the parameters and every list validated — until the call asks the driver for the
  device's architecture (no driver here: the exception ends the timing). The bound path does none of this
  per step; its run() (a call copy, the runtime params, check_call, three launches, an event) is not
  measurable without a GPU.
--before REV also times the optimizer of that git revision (python/kspec/optim.py) the same way.
Prints the median over steps in µs, and JSON with --json.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
import types

import torch

import kspec
import kspec._core
import kspec.optim


def gpt350m_shapes(vocab=50304, d=1024, layers=24, positions=1024):
    shapes = [(vocab, d), (positions, d)]
    for _ in range(layers):
        shapes += [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,)]


def make_params(shapes):
    ps = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    for p in ps:
        p.grad = torch.empty(p.shape)
    return ps


def median_us(fn, steps):
    fn()  # first step: state init, bind
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


class _NoBound:
    def __init__(self, *args):
        pass

    def run(self, *args):
        pass

    def idle(self):
        return True


def python_part(optim_module, ps, steps):
    """The optimizer's step with the native calls stubbed out."""
    calls = {"n": 0}
    real_call, real_c = kspec._core._C.call, getattr(optim_module, "_C", None)
    real_stream = getattr(optim_module, "current_stream", None)
    kspec._core._C.call = lambda *a, **k: calls.__setitem__("n", calls["n"] + 1)
    if real_c is not None:
        optim_module._C = types.SimpleNamespace(BoundCall=_NoBound)
    if real_stream is not None:
        optim_module.current_stream = lambda *a: 0
    try:
        opt = optim_module.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        us = median_us(opt.step, steps)
    finally:
        kspec._core._C.call = real_call
        if real_c is not None:
            optim_module._C = real_c
        if real_stream is not None:
            optim_module.current_stream = real_stream
    return us, calls["n"]


def cpp_part(ps, steps):
    """_C.call's argument conversion and validation (fake cuda:0 descriptors), up to the first driver use."""
    from kspec._tensors import describe

    def gpu(d):
        return (d[0] or 256, d[1], d[2], d[3], 0)

    m = [torch.empty(p.shape) for p in ps]
    v = [torch.empty(p.shape) for p in ps]
    lists = [[gpu(describe(t)) for t in lst] for lst in (ps, [p.grad for p in ps], m, v)]
    params = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1, maximize=False, max_norm=0.0)
    reached = {}

    def one():
        try:
            kspec._C.call("adamw", lists + [None, None, None], [None, None], params, 0, None)
        except Exception as e:  # noqa: BLE001  (no driver: the call stops before its plan)
            reached["stop"] = f"{type(e).__name__}: {str(e)[:100]}"

    return median_us(one, steps), reached.get("stop", "")


def load_before(rev):
    src = subprocess.run(["git", "show", f"{rev}:python/kspec/optim.py"], capture_output=True, text=True, check=True)
    mod = types.ModuleType("kspec.optim_before")
    mod.__package__ = "kspec"
    exec(compile(src.stdout, f"{rev}:python/kspec/optim.py", "exec"), mod.__dict__)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--before", metavar="REV", help="also time python/kspec/optim.py of this git revision")
    ap.add_argument("--json")
    a = ap.parse_args()
    shapes = gpt350m_shapes()
    ps = make_params(shapes)
    n = sum(p.numel() for p in ps)
    out = {"tensors": len(ps), "params": n, "torch": torch.__version__}
    print(f"adamw host time: {len(ps)} tensors, {n / 1e6:.1f} M parameters (fp32, host memory)")
    if a.before:
        before = load_before(a.before)
        us, calls = python_part(before, make_params(shapes), a.steps)
        out["before_python_us"] = us
        print(f"  {a.before}: optimizer Python per step          {us:8.0f} µs ({calls} native calls stubbed)")
    us, calls = python_part(kspec.optim, ps, a.steps)
    out["python_us"] = us
    print(f"  this tree: optimizer Python per step (bound)  {us:8.0f} µs")
    cpp, stop = cpp_part(ps, a.steps)
    out["cpp_call_validation_us"] = cpp
    out["cpp_stop"] = stop
    print(f"  _C.call conversion + validation (per-step path, not the bound one) {cpp:8.0f} µs (stopped at: {stop})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
