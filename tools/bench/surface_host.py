"""Host cost of the generated torch surface (kspec._surface) and of output allocation, on CPU tensors (no
GPU needed): the registry call is stubbed out (it returns preallocated outputs), so what is timed is the
Python/torch layer alone. Prints the best of 9 rounds per row (rows interleaved, so a loaded machine
slows them alike) and, deterministic, the Python-level calls per call (cProfile's count).

    python3 tools/bench/surface_host.py
"""
import cProfile
import pstats
import time

import torch

import kspec
from kspec import _surface, _torch

x = torch.randn(4, 256)
xg = x.clone().requires_grad_()
w = torch.randn(256)
outs = (torch.empty(4, 256), torch.empty(4), torch.empty(4))
grads = (torch.empty(4, 256), torch.empty(256), None)


def stub(op, *inputs, **params):
    return outs if op == "norm_act.fwd" else grads


class HandWritten(torch.autograd.Function):
    """The eager Function as it was written per family before the surface was generated."""

    @staticmethod
    def forward(ctx, x, weight, bias, norm, act, eps):
        y, mean, rstd = stub("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.cfg = (norm, act, eps)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        norm, act, eps = ctx.cfg
        dx, dw, db = stub("norm_act.bwd", dy, x, weight, bias, mean, rstd, norm=norm, act=act, eps=eps)
        return dx, dw, db, None, None, None


def carve(buf_bytes, specs):
    """Outputs as views of one byte buffer: a dtype view and an as_strided per output."""
    buf = torch.empty(buf_bytes, dtype=torch.uint8)
    views, off = [], 0
    for shape, dt, nbytes in specs:
        views.append(buf[off:off + nbytes].view(dt).view(shape))
        off += nbytes
    return views


NORM_ACT_OUTS = [((4, 256), torch.bfloat16, 2048), ((4,), torch.float32, 16), ((4,), torch.float32, 16)]
surface = _torch.norm_act
ROWS = [
    ("kspec.ops.norm_act, no grad (public entry)", lambda: kspec.ops.norm_act(x, w, None, norm="rmsnorm")),
    ("kspec.ops.norm_act, input requires grad", lambda: kspec.ops.norm_act(xg, w, None, norm="rmsnorm")),
    ("generated surface, no grad (the forward alone)", lambda: surface(x, w, None, "rmsnorm", "identity", 1e-5, True)),
    ("generated surface, input requires grad", lambda: surface(xg, w, None, "rmsnorm", "identity", 1e-5, True)),
    ("hand-written autograd.Function.apply", lambda: HandWritten.apply(xg, w, None, "rmsnorm", "identity", 1e-5)),
    ("generated forward + backward", lambda: surface(xg, w, None, "rmsnorm", "identity", 1e-5, True).backward(outs[0])),
    ("hand-written forward + backward",
     lambda: HandWritten.apply(xg, w, None, "rmsnorm", "identity", 1e-5).backward(outs[0])),
    ("torch.empty x 3 (norm_act's outputs)",
     lambda: [torch.empty(s, dtype=d) for s, d, _ in NORM_ACT_OUTS]),
    ("one torch.empty carved into 3 views", lambda: carve(2080, NORM_ACT_OUTS)),
]


def main():
    _torch.call = _surface.call = stub
    n, best = 3000, {name: float("inf") for name, _ in ROWS}
    for name, fn in ROWS:
        for _ in range(300):
            fn()
    for _ in range(9):
        for name, fn in ROWS:
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.perf_counter_ns() - t0) / n / 1000)
    print(f"{'row':50s} {'µs':>8s} {'py calls':>9s}")
    for name, fn in ROWS:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            fn()
        prof.disable()
        print(f"{name:50s} {best[name]:8.2f} {pstats.Stats(prof).total_calls / 100:9.1f}")


if __name__ == "__main__":
    main()
