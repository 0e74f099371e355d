#!/usr/bin/env python3
"""One selective_scan.bwd call at a Mamba shape (for a profiler: ncu --kernel-name regex:bwd ...).

    python3 tools/gpu/profile_scan_bwd.py [--config algo=sequential,...] [B D L]
"""
import argparse

import torch

import kspec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8, 2048, 2048])
    ap.add_argument("--config", default=None)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    b, d, t = a.shape
    n = 16
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, dt=bf: torch.randn(*s, device=dev, dtype=dt, generator=g)  # noqa: E731
    u, delta, z, dout = r(b, d, t), r(b, d, t) * 0.5 - 1.0, r(b, d, t), r(b, d, t)
    A = -torch.rand(d, n, device=dev, generator=g) - 0.5
    B, C = r(b, 1, n, t), r(b, 1, n, t)
    D, bias = torch.randn(d, device=dev, generator=g), torch.randn(d, device=dev, generator=g) * 0.1
    kw = dict(delta_softplus=True)
    if a.config:
        kw["config"] = a.config
    for _ in range(a.reps):
        kspec.call("selective_scan.bwd", dout, u, delta, A, B, C, D, z, bias, None, None, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
