"""Where the host time of a selective_scan training step goes (kspec.ops.selective_scan_fn forward +
backward through autograd), at one shape: per-piece host microseconds (perf_counter_ns around the raw
calls, the autograd forward, the backward) and a cProfile of the loop. A diagnosis tool for the GPU machine."""
import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import kspec


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="2x4096x333")
    p.add_argument("--json")
    a = p.parse_args()
    b, d, t = (int(v) for v in a.shape.split("x"))
    n = 16
    dev = "cuda"
    bf = torch.bfloat16
    x = dict(u=torch.randn(b, d, t, device=dev, dtype=bf), delta=torch.randn(b, d, t, device=dev, dtype=bf) * 0.5 - 1,
             A=-(0.25 + torch.rand(d, n, device=dev)), B=torch.randn(b, 1, n, t, device=dev, dtype=bf),
             C=torch.randn(b, 1, n, t, device=dev, dtype=bf), D=torch.randn(d, device=dev),
             z=torch.randn(b, d, t, device=dev, dtype=bf), delta_bias=torch.randn(d, device=dev) * 0.1)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    dout = torch.randn_like(x["u"])
    args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    largs = [leaves[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    out = torch.empty_like(x["u"])
    last = torch.empty(b, d, n, device=dev)
    states = torch.empty(b, d, -(-t // 16), n, device=dev)
    r = {}
    r["raw_fwd_out"] = per_call_us(lambda: kspec.call("selective_scan.fwd", *args, None, delta_softplus=True,
                                                      out=(out, last, states)))
    r["raw_fwd_alloc"] = per_call_us(lambda: kspec.call("selective_scan.fwd", *args, None, delta_softplus=True))
    r["raw_bwd_alloc"] = per_call_us(lambda: kspec.call("selective_scan.bwd", dout, *args, None, None, states,
                                                        delta_softplus=True))
    r["fn_nograd"] = per_call_us(lambda: kspec.ops.selective_scan_fn(*args, delta_softplus=True))
    r["fn_grad_fwd"] = per_call_us(lambda: kspec.ops.selective_scan_fn(*largs, delta_softplus=True))

    def step():
        for v in leaves.values():
            v.grad = None
        kspec.ops.selective_scan_fn(*largs, delta_softplus=True).backward(dout)

    r["fwdbwd_step"] = per_call_us(step, 100)
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as peer

        def pstep():
            for v in leaves.values():
                v.grad = None
            peer(*largs, delta_softplus=True).backward(dout)
        r["mamba_fwdbwd_step"] = per_call_us(pstep, 100)
        r["mamba_fwd_nograd"] = per_call_us(lambda: peer(*args, delta_softplus=True))
    except Exception as e:  # noqa: BLE001
        r["mamba"] = str(e)[:200]
    for k, v in r.items():
        print(f"{a.shape} {k:>22}: {v if isinstance(v, str) else f'{v:9.1f} us'}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    if a.json:
        json.dump(r, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
