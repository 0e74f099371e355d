#!/usr/bin/env python3
"""After `kspec tune gemm`: does dispatch use the tuned cuBLASLt algorithm, is it faster, is it right? (GPU)

  python3 tools/gpu/tune_gemm_check.py --shape 16384,4096,4096 --shape 4097,4095,33:gelu --json OUT.json

For each problem (m,n,k[:act], bf16, with bias, no saved pre-activation) in the tuning database that
KSPEC_TUNING_DB names: kspec.explain must report the tuned config; then three ways of calling are timed
on the same tensors: dispatch (the tuned algorithm), the forced empty config (cuBLASLt's heuristic, what
an untuned call runs) and torch (linear + the activation); each output's first and last rows are checked
against a float64 product. Timing: batches of calls queued behind torch.cuda._sleep, CUDA events, the
median of batches, the inputs rotated over copies larger than the L2. Exits 1 when a check fails.
"""
import argparse
import json
import statistics
import sys

import torch

import kspec


def timed(fn, sets, batches=15):
    """Median ms per call over batches of calls rotated across input sets, queued behind a spin."""
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(5):
        fn(*sets[i % len(sets)])
    b.record()
    b.synchronize()
    est = max(a.elapsed_time(b) / 5, 1e-3)
    k = max(1, min(100, int(0.5 / est + 1)))
    out = []
    for _ in range(batches):
        torch.cuda._sleep(int(2e6))  # ~1 ms of spin: the host queues the batch behind it
        a.record()
        for i in range(k):
            fn(*sets[i % len(sets)])
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / k)
    return statistics.median(out)


def reference_rows(x, w, b, act, rows):
    pre = x[rows].double() @ w.double().t() + b.double()
    if act == "gelu":
        return torch.nn.functional.gelu(pre, approximate="tanh")
    return torch.relu(pre) if act == "relu" else pre


def check(m, n, k, act):
    dt = torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    per_set = 2 * (m * k + n * k + n)
    sets = [(torch.randn(m, k, device="cuda").to(dt), torch.randn(n, k, device="cuda").to(dt) * k ** -0.5,
             torch.randn(n, device="cuda").to(dt)) for _ in range(max(1, min(16, 3 * l2 // per_set + 1)))]
    x, w, b = sets[0]
    e = kspec.explain("gemm", x, w, b, act=act)
    row = {"shape": f"{m}x{n}x{k}", "act": act, "bias": True, "config_source": e.config_source, "config": e.config,
           "tuning_key": e.tuning_key, "note": e.note}
    tact = {"none": lambda t: t, "relu": torch.relu,
            "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[act]
    ways = {
        "dispatch (tuned)": lambda x, w, b: kspec.call("gemm", x, w, b, act=act)[0],
        "cuBLASLt heuristic": lambda x, w, b: kspec.call("gemm", x, w, b, act=act, config="")[0],
        "torch": lambda x, w, b: tact(torch.nn.functional.linear(x, w, b)),
    }
    rows = torch.cat([torch.arange(0, min(64, m)), torch.arange(max(0, m - 64), m)]).cuda()
    want = reference_rows(x, w, b, act, rows)
    flops = 2.0 * m * n * k
    row["ways"] = {}
    ok = e.config_source == "tuned"
    for name, fn in ways.items():
        got = fn(x, w, b)[rows].double()
        err = float((got - want).norm() / want.norm())
        ms = timed(fn, sets)
        row["ways"][name] = {"ms": ms, "tflops": flops / (ms * 1e9), "rel_err": err}
        ok = ok and err <= 1e-2
    row["speedup_over_heuristic"] = row["ways"]["cuBLASLt heuristic"]["ms"] / row["ways"]["dispatch (tuned)"]["ms"]
    row["ok"] = ok
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, help="M,N,K[:ACT] (act none|relu|gelu)")
    ap.add_argument("--json")
    a = ap.parse_args()
    results = []
    for item in a.shape:
        dims, _, act = item.partition(":")
        m, n, k = (int(v) for v in dims.split(","))
        r = check(m, n, k, act or "none")
        results.append(r)
        ways = "; ".join(f"{name} {v['ms']:.4f} ms {v['tflops']:.0f} TFLOP/s err {v['rel_err']:.1e}"
                         for name, v in r["ways"].items())
        print(f"gemm {r['shape']} bias+{r['act']}: {r['config_source']} {{{r['config']}}}: {ways};"
              f" tuned/heuristic {r['speedup_over_heuristic']:.2f}x  {'ok' if r['ok'] else 'FAILED'}"
              + (f"  ({r['note']})" if r["note"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
