#!/usr/bin/env python3
"""Kernel-level timing of mlstm.chunkwise.fwd and .bwd: algo=simt (the correct-first kernels) against
algo=tc (tensor cores) at issue 29's anchor, B=8, NH=8, DHQK=DHHV=128, bf16, chunk 128, S in {4096, 8192}.
Each shape first checks tc's outputs against simt's (forward: h, nrm, m; backward, both from simt's nrm
and m: dq, dk, dv, di, df), then times each algo: CUDA events around the call(s), median of 30 after 5
warm-up calls (simt, tens of ms a call: median of 3 after 1), L2 flushed (a 256 MB write) before every
timed call; "fwd+bwd" is one forward and one backward of the same algo. TFLOP/s by the issue's formula (per token and head 4 DHQK DHHV + 128 (DHQK +
DHHV) forward, x3 with the backward).

    python3 tools/gpu/profile_mlstm.py [--seqlens 4096 8192] [--dtype bf16] [--chunk 128] [--reps 30]

--compare (issue 29's open rows, old against new in one process, < 90 s): at B=8, NH=8, S=4096, bf16, chunk
128 and DHQK x DHHV in {128 x 128, 128 x 256, 256 x 512}, the forward's algo=tc_wide, tc_q128 and
tc_wide_q128 against tc (FWD_ALGOS),
and the backward's variants (BWD_ALGOS: algo=tc; tc_merged, two launches fewer; tc_stream at 256 x 512;
tc_fused at 128 x 128, never timed there; tc_wide, the state scans on 128 x 128 tiles), each checked
against tc first,
then bwd alone and fwd+bwd (algo=tc's forward, then the variant's backward) in ms, beside mlstm_kernels'
xl_chunk at chunk 128 (autograd, fwd and fwd+bwd) where it imports, and each fwd+bwd's ratio to it (issue
29's target: 1.3x).

--kernels: the same variants kernel by kernel (GPU µs per call from torch.profiler; where the time goes).

--step: mlstm.step at NH=8, DH=128, B in {1, 8, 64}, in place: the default (algo=split, heuristic slabs),
split over slabs of 16 and algo=block (the first kernel), each checked against the default, and
mlstm_kernels' Triton step where it imports; gpu (spin-queued), ev (plain events: includes kspec.call's host
enqueue) and host µs each.
"""
import argparse
import os
import statistics
import sys

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


# --compare's shapes and, per shape, the backward's variants timed (the first is the baseline the others are
# checked against): tc_merged everywhere, tc_stream at 256 x 512 (where it differs), tc_fused at 128 x 128
# (timed only at 128 x 256, where it keeps dk's partials, so far).
COMPARE_DIMS = ((128, 128), (128, 256), (256, 512))
BWD_ALGOS = {(128, 128): ("tc", "tc_merged", "tc_fused", "tc_wide"), (128, 256): ("tc", "tc_merged", "tc_wide"),
             (256, 512): ("tc", "tc_merged", "tc_stream", "tc_wide")}
# The forward's variants, the first the baseline: algo=tc_wide (state scans on 128 x 128 tiles), tc_q128
# (the output kernel on 128 query rows) and both, beside tc.
FWD_ALGOS = ("tc", "tc_wide", "tc_q128", "tc_wide_q128")


def xl_chunk():
    """mlstm_kernels' xl_chunk chunkwise kernels (autograd), or None where it is not importable."""
    os.environ.setdefault("DISABLE_LLVM_OPT", "1")  # triton 3.6's LLVM crashes on xl_chunk otherwise
    try:
        from mlstm_kernels.torch.chunkwise import mlstm_chunkwise__xl_chunk
    except Exception:  # noqa: BLE001  (absent: the table says so)
        return None
    return mlstm_chunkwise__xl_chunk


def compare_problem(B, NH, S, DK, DV, L, dt):
    """--compare's and --kernels' problem at head dims DK x DV: q, k, v (B, NH, S, DK or DV), i, f (B, NH, S) and dh
    in dt from a generator seeded with DK + DV, the forward's outputs, and the tc forward's nrm and m (what the
    backward reads)."""
    g = torch.Generator(device="cuda").manual_seed(DK + DV)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = r(B, NH, S, DK).to(dt), r(B, NH, S, DK).to(dt), r(B, NH, S, DV).to(dt)
    i, f, dh = r(B, NH, S).to(dt), (r(B, NH, S) + 3.0).to(dt), r(B, NH, S, DV).to(dt)
    out = outputs(v, i)
    _, nrm, m = forward(q, k, v, i, f, L, CONFIGS["tc"], out)
    return q, k, v, i, f, dh, out, nrm, m


def compare(reps, flush):
    """--compare: see the module's doc."""
    dt, B, NH, S, L = torch.bfloat16, 8, 8, 4096, 128
    peer = xl_chunk()
    print(f"{torch.cuda.get_device_name()}  B={B} NH={NH} S={S} bf16 chunk {L} (ms, median of {reps}, L2 flushed)"
          + ("" if peer else "; mlstm_kernels absent (not importable)"))
    for DK, DV in COMPARE_DIMS:
        q, k, v, i, f, dh, out, nrm, m = compare_problem(B, NH, S, DK, DV, L, dt)
        algos = BWD_ALGOS[(DK, DV)]
        cfg = {a: f"algo={a},threads=128" for a in algos}
        gr = {a: backward(q, k, v, i, f, nrm, m, dh, L, cfg[a], grads(q, k, v, i)) for a in algos}
        torch.cuda.synchronize()
        fwd_ms = time_ms(lambda: forward(q, k, v, i, f, L, CONFIGS["tc"], out), reps, flush)
        for a in FWD_ALGOS[1:]:
            alt = forward(q, k, v, i, f, L, f"algo={a},threads=128", outputs(v, i))
            torch.cuda.synchronize()
            errs = "  ".join(f"{n} {rel_max(x, y):.1e}" for n, x, y in zip(("h", "nrm", "m"), alt, out))
            ms = time_ms(lambda a=a, alt=alt: forward(q, k, v, i, f, L, f"algo={a},threads=128", alt), reps, flush)
            print(f"{DK}x{DV}: kspec {a} fwd {ms:8.3f} (tc {fwd_ms:8.3f}: {fwd_ms / ms:.2f}x)   vs tc: {errs}")
        peer_ms = None
        if peer:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, i, f)]
            run_peer = lambda x: peer(q=x[0], k=x[1], v=x[2], i=x[3], f=x[4], chunk_size=L)  # noqa: E731

            def peer_both():
                for t in leaves:
                    t.grad = None
                run_peer(leaves).backward(dh)

            with torch.no_grad():
                peer_fwd = time_ms(lambda: run_peer((q, k, v, i, f)), reps, flush)
            peer_ms = time_ms(peer_both, reps, flush)
            print(f"{DK}x{DV}: mlstm_kernels xl_chunk L={L}  fwd {peer_fwd:8.3f}  fwd+bwd {peer_ms:8.3f}   "
                  f"kspec tc fwd {fwd_ms:8.3f} ({peer_fwd / fwd_ms:.2f}x)")
        else:
            print(f"{DK}x{DV}: kspec tc fwd {fwd_ms:8.3f}")
        for a in algos:
            errs = "  ".join(f"{n} {rel_max(x, y):.1e}"
                             for n, x, y in zip(("dq", "dk", "dv", "di", "df"), gr[a], gr[algos[0]]))
            bwd = time_ms(lambda a=a: backward(q, k, v, i, f, nrm, m, dh, L, cfg[a], gr[a]), reps, flush)
            both = time_ms(lambda a=a: backward(q, k, v, i, f, *forward(q, k, v, i, f, L, CONFIGS["tc"], out)[1:],
                                                 dh, L, cfg[a], gr[a]), reps, flush)
            vs = f" ({peer_ms / both:.2f}x)" if peer_ms else ""
            print(f"  {a:9s} bwd {bwd:8.3f}  fwd+bwd {both:8.3f}{vs}   vs {algos[0]}: {errs}")
        del q, k, v, i, f, dh, out, nrm, m, gr
        torch.cuda.empty_cache()


# mlstm.step's configs beside the default (algo=split at the heuristic's slab width: 8 columns at B = 1,
# 32 from B = 8 on at NH = 8, DH = 128): split over slabs of 16 (the default at B = 1 before), block.
STEP_CONFIGS = (None, "algo=split,threads=256,cols=16", "algo=block,threads=256,cols=16")


def triton_step():
    """mlstm_kernels' Triton step (new states out of place), or None where it is not importable."""
    os.environ.setdefault("DISABLE_LLVM_OPT", "1")
    try:
        from mlstm_kernels.torch.recurrent.triton_step import mlstm_recurrent_step__triton_fw
    except Exception:  # noqa: BLE001  (absent: the table says so)
        return None
    return lambda q, k, v, i, f, C, n, m: mlstm_recurrent_step__triton_fw(
        matC_old=C, vecN_old=n, scaM_old=m, vecQ=q, vecK=k, vecV=v, scaI=i, scaF=f, eps=1e-6)


def step_compare():
    """mlstm.step at NH=8, DH=128, B = 1/8/64, in place, each config against the default's h and C', and
    the Triton step in the same process. Two times a call (tools/bench/timing.py's GpuTimer, L2 not
    flushed: decode keeps C resident only when it fits): gpu, with a GPU spin queued before the start
    event so that the whole call is queued when the clock starts (the kernels' own time), and ev, plain
    events around the call (what this table printed before: the host's enqueue time of kspec.call, tens of
    µs from Python, counts in it whenever it is longer than the GPU's work); host is that enqueue time."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from timing import GpuTimer

    timer = GpuTimer(torch, "cuda", reps=200, warmup=10, flush_bytes=4)
    peer = triton_step()
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    print("mlstm.step NH=8 DH=128 bf16, in place (µs, median of 200, L2 not flushed): gpu / ev / host"
          + ("" if peer else "; Triton step absent (mlstm_kernels not importable)"))
    for Bs in (1, 8, 64):
        q1, k1, v1 = r(Bs, 8, 128).to(dt), r(Bs, 8, 128).to(dt), r(Bs, 8, 128).to(dt)
        i1, f1 = r(Bs, 8, 1).to(dt), (r(Bs, 8, 1) + 3.0).to(dt)
        C, n, m1 = r(Bs, 8, 128, 128), r(Bs, 8, 128).abs(), r(Bs, 8, 1)
        cells, first = [], None
        for cfg in STEP_CONFIGS:
            st = (C.clone(), n.clone(), m1.clone())
            h = torch.empty_like(v1)
            kspec.call("mlstm.step", q1, k1, v1, i1, f1, *st, out=(h, *st), config=cfg)
            got = (h.clone(), st[0].clone())
            first = first or got
            t = timer.time(lambda cfg=cfg, st=st, h=h: kspec.call("mlstm.step", q1, k1, v1, i1, f1, *st,
                                                                  out=(h, *st), config=cfg))
            name = "default" if cfg is None else cfg.replace("algo=", "").replace(",threads=256", "")
            err = "" if cfg is None else f" (h {rel_max(got[0], first[0]):.0e} C {rel_max(got[1], first[1]):.0e})"
            cells.append(f"{name} {t['gpu_ms'] * 1e3:.1f} / {t['ev_ms'] * 1e3:.1f} / {t['host_us']:.1f}{err}")
        if peer:
            h_t, (C_t, _, _) = peer(q1, k1, v1, i1, f1, C, n, m1)
            t = timer.time(lambda: peer(q1, k1, v1, i1, f1, C, n, m1))
            cells.append(f"triton {t['gpu_ms'] * 1e3:.1f} / {t['ev_ms'] * 1e3:.1f} / {t['host_us']:.1f}"
                         f" (h {rel_max(h_t.reshape(first[0].shape), first[0]):.0e}"
                         f" C {rel_max(C_t.reshape(C.shape), first[1]):.0e})")
        print(f"  B={Bs:3d}  " + "  ".join(cells))


def kernel_times(fn, reps):
    """{kernel name without its template arguments: (launches per call, GPU µs per call)} of fn() from
    torch.profiler's CUDA activity (CUPTI sees kspec's cuLaunchKernel launches as any other)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        name = e.key.split("<")[0].replace("void ", "").replace("kspec::", "")
        if us and "mlstm" in name:
            n, t = out.get(name, (0, 0.0))
            out[name] = (n + e.count / reps, t + us / reps)
    return out


def kernels(reps):
    """--kernels: where the time of each forward and backward variant of --compare goes, kernel by kernel
    (GPU µs per call from the profiler, L2 not flushed), at B=8, NH=8, S=4096, bf16, chunk 128."""
    dt, B, NH, S, L = torch.bfloat16, 8, 8, 4096, 128
    print(f"{torch.cuda.get_device_name()}  B={B} NH={NH} S={S} bf16 chunk {L}: GPU µs per call by kernel "
          f"(profiler, {reps} calls)")
    for DK, DV in COMPARE_DIMS:
        q, k, v, i, f, dh, out, nrm, m = compare_problem(B, NH, S, DK, DV, L, dt)
        gr = grads(q, k, v, i)
        rows = [(f"fwd {a}", lambda a=a: forward(q, k, v, i, f, L, f"algo={a},threads=128", out)) for a in FWD_ALGOS]
        rows += [(f"bwd {a}", lambda a=a: backward(q, k, v, i, f, nrm, m, dh, L, f"algo={a},threads=128", gr))
                 for a in BWD_ALGOS[(DK, DV)]]
        for label, fn in rows:
            try:
                times = kernel_times(fn, reps)
            except Exception as e:  # noqa: BLE001  (an invalid config at this shape: say so, go on)
                print(f"  {DK}x{DV} {label}: {type(e).__name__}: {str(e)[:120]}")
                continue
            total = sum(t for _, t in times.values())
            parts = "  ".join(f"{name} {t:.0f}" + (f" (x{n:.0f})" if n > 1 else "")
                              for name, (n, t) in sorted(times.items(), key=lambda kv: -kv[1][1]))
            print(f"  {DK}x{DV} {label:16s} {total:8.0f} µs: {parts}")
        del q, k, v, i, f, dh, out, nrm, m, gr
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", action="store_true",
                    help="old against new: the backward's variants at issue 29's head dims, beside xl_chunk")
    ap.add_argument("--step", action="store_true", help="mlstm.step's configs beside the Triton step")
    ap.add_argument("--kernels", action="store_true",
                    help="GPU time of each kernel of --compare's forward and backward variants (torch.profiler)")
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
    if a.compare or a.step or a.kernels:
        if a.compare:
            compare(a.reps, flush)
        if a.kernels:
            kernels(min(a.reps, 10))
        if a.step:
            step_compare()
        return
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
