"""The host µs of a selective_scan training step on a machine without a GPU (tools/bench/dispatch_host.py's mock
CUDA driver: torch's CPU tensors through the torch extension and kspec::call, kernels compiled, launches counted,
nothing computed), per path, timed in interleaved rounds beside the floor that issue 33's "ev" column is read
against:
  - call_grad: the default, one C++ call in (forward op, outputs and `states` allocated in C++) and one C++ node
    out (selective_scan.bwd run by the node, no Python frame in the backward);
  - record: the path before it, the surface's Python forward and the record node whose backward calls Python
    (Surface._native_backward -> _grads_of -> _scan_bwd -> kspec.call); still save_states=False's path;
  - floor: a no-op autograd.Function of the scan's 8 inputs (out and 8 gradients allocated, no kernel): the
    probe's (tools/gpu/profile_scan_host.py), as the GPU bench's floor row (tools/bench/selective_scan.py);
  - no-op C++ node: the same without Python in the step but the call (kspec._torch_ext.noop_grad: out and the 8
    gradients allocated by a C++ node, as call_grad's): the floor of call_grad's step, the rest is kspec's;
  - bare backward: torch.autograd.backward through a one-op graph of one element (a view and AccumulateGrad):
    the engine's own cost per backward call.
Each row: median µs of a whole step (gradients reset, forward, backward) and of its forward alone, then the
Python-level calls per step (cProfile). CPU allocations stand in for the caching allocator's; a CPU graph's
backward runs on the calling thread (a CUDA graph's on the device thread, whose GIL hand-off the C++ node
avoids): so the differences between rows, not the µs themselves, carry over to the H100.

    python3 tools/bench/selective_scan_host.py [--steps N] [--rounds R] [--shapes 1x2048x512,...] [--callgrind]

--callgrind: instructions per step of each row instead (valgrind's callgrind, exact whatever the machine's load;
--steps steps a row, less an empty row's; the kernels must be in kspec's disk cache from a run without it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dispatch_host as dh  # noqa: E402


def _leaves(torch, b, d, t, n=16):
    bf = torch.bfloat16
    vals = [torch.randn(b, d, t, dtype=bf), torch.rand(b, d, t, dtype=bf) * 0.1, -(0.25 + torch.rand(d, n)),
            torch.randn(b, 1, n, t, dtype=bf), torch.randn(b, 1, n, t, dtype=bf), torch.randn(d),
            torch.randn(b, d, t, dtype=bf), torch.randn(d) * 0.1]
    return [v.requires_grad_() for v in vals]


def paths():
    """{name: (enter, leave)}: what each path switches on and back off."""
    from kspec import _torch

    surf = _torch.selective_scan
    grad_call = surf.grad_call

    def record_on():
        surf.grad_call = None

    def record_off():
        surf.grad_call = grad_call
    return {"call_grad (C++ node)": (lambda: None, lambda: None), "record (Python backward)": (record_on, record_off)}


def step_rows(torch, leaves, dout):
    """{name: (enter, leave, forward, backward)} for one shape's leaves."""
    import kspec
    from kspec import _native
    from profile_scan_host import NoopScan  # the probe's floor: the GPU bench's floor row, in torch's graph

    one = torch.zeros(1, requires_grad=True)
    one_grad = torch.ones(1)
    inputs = tuple(leaves)
    rows = {}
    for name, (enter, leave) in paths().items():
        rows[name] = (enter, leave, lambda: kspec.ops.selective_scan_fn(*leaves, delta_softplus=True),
                      lambda y: y.backward(dout))
    rows["floor: no-op autograd.Function"] = (lambda: None, lambda: None, lambda: NoopScan.apply(*leaves),
                                              lambda y: y.backward(dout))
    rows["no-op C++ node"] = (lambda: None, lambda: None, lambda: _native.ext.noop_grad(inputs),
                              lambda y: y.backward(dout))
    rows["bare backward (one view, 1 element)"] = (lambda: None, lambda: None, lambda: one.view_as(one),
                                                   lambda y: torch.autograd.backward(y, one_grad))
    return rows


def count_rows(a, shim):
    """The run under callgrind (--count): each row's --steps steps, one dump a row."""
    import torch

    lib = dh.counter_lib(shim)
    dh.instructions(lambda: None, a.steps, lib, "empty")
    for shape in a.shapes.split(","):
        b, d, t = (int(v) for v in shape.split("x"))
        leaves = _leaves(torch, b, d, t)
        dout = torch.randn(b, d, t, dtype=torch.bfloat16)
        for name, (enter, leave, fwd, bwd) in step_rows(torch, leaves, dout).items():
            def one():
                for v in leaves:
                    v.grad = None
                bwd(fwd())
            enter()
            try:
                dh.instructions(one, a.steps, lib, f"{shape} {name}")
            finally:
                leave()


def time_step(fwd, bwd, leaves, steps):
    """(median µs of the step, median µs of its forward)."""
    total, forward = [], []
    clock = time.perf_counter_ns
    for _ in range(steps):
        for v in leaves:
            v.grad = None
        t0 = clock()
        y = fwd()
        t1 = clock()
        bwd(y)
        t2 = clock()
        total.append(t2 - t0)
        forward.append(t1 - t0)
    return statistics.median(total) / 1e3, statistics.median(forward) / 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="timed steps per path and round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", default="1x16x32,1x2048x512,2x4096x333,16x768x256")
    p.add_argument("--cuda-include", default=os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"))
    p.add_argument("--callgrind", action="store_true", help="instructions per step under valgrind's callgrind")
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # the run under callgrind
    a = p.parse_args()
    if a.callgrind:
        dh.callgrind([arg for arg in sys.argv[1:] if arg != "--callgrind"], a.steps, script=__file__)
        return
    mock, shim = dh.build(a.cuda_include)
    dh.select(mock)
    import torch

    import kspec
    import kspec._torch  # noqa: F401  (loads the extension)

    dh.install_shim(shim)
    sys.path.insert(0, os.path.join(dh.ROOT, "tools", "gpu"))
    if a.count:
        return count_rows(a, shim)
    print(f"kspec {kspec.__file__}: selective_scan fwd+bwd step on the mock driver, host µs (median of {a.rounds} "
          f"rounds' medians of {a.steps} steps), Python calls per step")
    print(f"{'shape':>12} {'path':28s} {'step µs':>9} {'fwd µs':>8} {'- floor':>8} {'py calls':>9}")
    for shape in a.shapes.split(","):
        b, d, t = (int(v) for v in shape.split("x"))
        leaves = _leaves(torch, b, d, t)
        dout = torch.randn(b, d, t, dtype=torch.bfloat16)
        rows = step_rows(torch, leaves, dout)
        got = {name: ([], []) for name in rows}
        for r in range(a.rounds):
            order = list(rows)
            order = order[r % len(order):] + order[:r % len(order)]
            for name in order:
                enter, leave, fwd, bwd = rows[name]
                enter()
                try:
                    time_step(fwd, bwd, leaves, 3)  # warm
                    step_us, fwd_us = time_step(fwd, bwd, leaves, a.steps)
                finally:
                    leave()
                got[name][0].append(step_us)
                got[name][1].append(fwd_us)
        floor = statistics.median(got["floor: no-op autograd.Function"][0])
        for name, (enter, leave, fwd, bwd) in rows.items():
            enter()
            try:
                def one():
                    for v in leaves:
                        v.grad = None
                    bwd(fwd())
                calls = dh.py_calls(one, n=20)
            finally:
                leave()
            step_us, fwd_us = statistics.median(got[name][0]), statistics.median(got[name][1])
            print(f"{shape:>12} {name:28s} {step_us:9.1f} {fwd_us:8.1f} {step_us - floor:+8.1f} {calls:9.1f}")


if __name__ == "__main__":
    main()
