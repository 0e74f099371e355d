#!/usr/bin/env python3
"""One difflogic.packed.net call per config at issue 30 (b)'s network (784 -> 6 x 64k -> GroupSum(10)), for a
profiler: tools/gpu/profile_packed_net.sh runs it under ncu, one network kernel per config, in the order given
(the first call of a config compiles it on the host before its launch: no warm-up is needed for the kernel's
counters, and ncu flushes the caches before each profiled kernel anyway).

    python3 tools/gpu/profile_packed_net.py [--batch 262144] [--w 32] [--configs 'CFG;CFG;...']
"""
import argparse

import torch

from kspec._core import call

N_IN, WIDTH, LAYERS, K = 784, 64000, 6, 10
CONFIGS = ("algo=chunked,chunk=128,inflight=2;algo=early,chunk=128,inflight=2;algo=early_late,chunk=128,inflight=2;"
           "algo=chunked,chunk=64,inflight=2;algo=fold,chunk=128,inflight=2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1 << 18)
    ap.add_argument("--w", type=int, choices=(32, 64), default=32)
    ap.add_argument("--configs", default=CONFIGS, help="';'-separated difflogic.packed.net configs")
    a = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(30)
    words = -(-a.batch // a.w)
    dt = torch.int32 if a.w == 32 else torch.int64
    # Random words: every bit a sample's input bit (bits of samples >= batch are ignored by the op).
    x = torch.randint(-2**31, 2**31 - 1, (N_IN, words * a.w // 32), device=dev, generator=g, dtype=torch.int64)
    x = x.to(torch.int32).view(dt).contiguous()
    logits, wa, wb, n = [], [], [], N_IN
    for _ in range(LAYERS):
        logits.append(torch.randn(WIDTH, 16, device=dev, generator=g))
        wa.append(torch.randint(0, n, (WIDTH,), device=dev, generator=g, dtype=torch.int32))
        wb.append(torch.randint(0, n, (WIDTH,), device=dev, generator=g, dtype=torch.int32))
        n = WIDTH
    counts = torch.empty(a.batch, K, dtype=torch.int32, device=dev)
    first = None
    for cfg in [c.strip() for c in a.configs.split(";") if c.strip()]:
        call("difflogic.packed.net", x, logits, wa, wb, config=cfg, out=(counts,))
        torch.cuda.synchronize()
        # Every config gives the same counts (a cheap check that the profiled kernels did the same work).
        same = "" if first is None else (" same counts as the first" if torch.equal(counts, first) else
                                         " DIFFERENT COUNTS from the first config")
        if first is None:
            first = counts.clone()
        print(f"profiled: {cfg} (B {a.batch}, w {a.w}){same}", flush=True)


if __name__ == "__main__":
    main()
