#!/usr/bin/env python3
"""mhc.pre.bwd alone, config by config, for a per-kernel profile (ncu or nsys around this script): issue 34's
shape (T 16384 = B 4 x S 4096, n 4, D 4096, bf16, t_max 20; no gamma, dh_post and dr given, no dx_post, as the
bench's rows). One forward (the heuristic's), then per --config: the backward's outputs checked bit for bit
against the first config's (dx, dalpha, dbias: every mma_fused* algo and mma_slice give the same bits; dphi and
dgamma the same bits among the mma_fused* algos, the order of the sums over tokens differs in mma_slice: their
largest difference relative to the first config's largest value is printed; algo=mma_slice_du1 (9) and its
per-group barrier variants 10 and 11 the same bits as one another, dx within ~2^-11 of mma_slice's), then CUDA-event
time of the backward alone (median of --reps after 3 warm-up calls, L2 flushed by a 256 MB write before each).

    python3 tools/gpu/profile_mhc_bwd.py --config algo=4,threads=128,tokens=32 --config algo=7,threads=128,tokens=16
    ncu --kernel-name regex:mhc_pre_bwd --metrics gpu__time_duration.sum,... python3 tools/gpu/profile_mhc_bwd.py ...
"""
import argparse
import statistics

import torch

import kspec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True, help="an mhc.pre.bwd config (repeatable)")
    ap.add_argument("--shape", default="16384x4x4096", help="tokens x streams x dim")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    T, n, D = (int(v) for v in a.shape.split("x"))
    M = n * n + 2 * n
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, n, D, generator=g).bfloat16().cuda()
    phi = (torch.randn(M, n * D, generator=g) / (n * D) ** 0.5).cuda()
    alpha, bias = torch.tensor([0.8, -0.6, 1.1]).cuda(), (0.5 * torch.randn(M, generator=g)).cuda()
    dy = torch.randn(T, D, generator=g).bfloat16().cuda()
    dh_post, dr = torch.randn(T, n, generator=g).cuda(), torch.randn(T, n, n, generator=g).cuda()
    _, _, _, _, inv, h = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, None)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def bwd(config):
        return kspec.call("mhc.pre.bwd", dy, x, phi, alpha, bias, None, inv, h, None, dh_post, dr, None,
                          config=config)

    first = None
    for config in a.config:
        out = bwd(config)
        if first is None:
            first = out
        names = ("dx", "dphi", "dalpha", "dbias", "dgamma")
        differ = [f"{k} {((o.float() - f.float()).abs().max() / f.float().abs().max()).item():.1e}"
                  for k, o, f in zip(names, out, first) if o is not None and not torch.equal(o, f)]
        for _ in range(3):
            bwd(config)
        times = []
        for _ in range(a.reps):
            flush.fill_(1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            bwd(config)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        print(f"mhc.pre.bwd {config}: {statistics.median(times):.0f} us (T {T}, n {n}, D {D}, bf16)"
              f"{'  BITS DIFFER from ' + a.config[0] + ': ' + ', '.join(differ) if differ else ''}", flush=True)


if __name__ == "__main__":
    main()
