#!/usr/bin/env python3
"""Kernel-level timing of mlstm.chunkwise.fwd and .bwd: algo=simt (the correct-first kernels) against
algo=tc (tensor cores) at issue 29's anchor, B=8, NH=8, DHQK=DHHV=128, bf16, chunk 128, S in {4096, 8192}.
Each shape first checks tc's outputs against simt's (forward: h, nrm, m; backward, both from simt's nrm
and m: dq, dk, dv, di, df), then times each algo: CUDA events around the call(s), median of 30 after 5
warm-up calls (simt, tens of ms a call: median of 3 after 1), L2 flushed (a 256 MB write) before every
timed call; "fwd+bwd" is one forward and one backward of the same algo. TFLOP/s by the issue's formula (per token and head 4 DHQK DHHV + 128 (DHQK +
DHHV) forward, x3 with the backward).

    python3 tools/gpu/profile_mlstm.py [--seqlens 4096 8192] [--dtype bf16] [--chunk 128] [--reps 30]
"""
import argparse
import statistics

import torch

import kspec

CONFIGS = {"simt": "algo=simt,threads=256", "tc": "algo=tc,threads=128"}


def outputs(v, i):
    """h (NaN-filled, so an unwritten element shows), nrm, m_rows."""
    rows = torch.full(i.shape, float("nan"), device=i.device, dtype=torch.float32)
    return torch.full_like(v, float("nan")), rows, rows.clone()


def forward(q, k, v, i, f, chunk, config, out):
    kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, None, None, None, out=(*out, None, None, None),
               chunk=chunk, config=config)
    return out


def backward(q, k, v, i, f, nrm, m, dh, chunk, config, out):
    kspec.call("mlstm.chunkwise.bwd", q, k, v, i, f, None, None, nrm, m, dh, None, out=(*out, None),
               chunk=chunk, config=config)
    return out


def grads(q, k, v, i):
    return tuple(torch.full_like(t, float("nan")) for t in (q, k, v, i, i))


def rel_max(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).abs().max() / ref.abs().max())


def time_ms(fn, reps, flush, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", nargs="*", type=int, default=[4096, 8192])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dh", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}  B={a.batch} NH={a.heads} DH={a.dh} {a.dtype} chunk {a.chunk}")
    for S in a.seqlens:
        g = torch.Generator(device="cuda").manual_seed(S)
        r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        B, NH, D = a.batch, a.heads, a.dh
        q, k, v = (r(B, NH, S, D).to(dt) for _ in range(3))
        i, f = r(B, NH, S).to(dt), (r(B, NH, S) + 3.0).to(dt)
        out = {name: forward(q, k, v, i, f, a.chunk, cfg, outputs(v, i)) for name, cfg in CONFIGS.items()}
        torch.cuda.synchronize()
        errs = [rel_max(x, y) for x, y in zip(out["tc"], out["simt"])]
        finite = all(bool(torch.isfinite(x).all()) for x in out["tc"])
        print(f"S={S}: tc vs simt max-rel  h {errs[0]:.2e}  nrm {errs[1]:.2e}  m {errs[2]:.2e}  "
              f"{'finite' if finite else 'NON-FINITE'}")
        dh = r(B, NH, S, D).to(dt)
        _, nrm, m = out["simt"]
        gr = {name: backward(q, k, v, i, f, nrm, m, dh, a.chunk, cfg, grads(q, k, v, i)) for name, cfg in CONFIGS.items()}
        torch.cuda.synchronize()
        errs = [rel_max(x, y) for x, y in zip(gr["tc"], gr["simt"])]
        finite = all(bool(torch.isfinite(x).all()) for x in gr["tc"])
        print("       bwd: tc vs simt max-rel  " + "  ".join(f"{n} {e:.2e}" for n, e in zip(("dq", "dk", "dv", "di", "df"), errs))
              + f"  {'finite' if finite else 'NON-FINITE'}")
        flop = B * NH * S * (4 * D * D + 128 * (D + D))
        for name, cfg in CONFIGS.items():
            o, g_ = out[name], gr[name]
            reps, warmup = (a.reps, 5) if name == "tc" else (3, 1)  # simt: tens of ms a call
            ms = time_ms(lambda: forward(q, k, v, i, f, a.chunk, cfg, o), reps, flush, warmup)
            both = time_ms(lambda: backward(q, k, v, i, f, *forward(q, k, v, i, f, a.chunk, cfg, o)[1:], dh, a.chunk,
                                            cfg, g_), reps, flush, warmup)
            print(f"  {name:5s} fwd {ms:8.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s   "
                  f"fwd+bwd {both:8.3f} ms {3 * flop / both / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
