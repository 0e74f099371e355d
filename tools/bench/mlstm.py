"""The mlstm benchmark (issue 29): the xLSTM mLSTM cell, bf16, forward and forward+backward, kspec's chunkwise
op against mlstm_kernels 2.0.6 (its Triton chunkwise kernels, when importable) and the parallel form in
torch eager and torch.compile, in one process."""
from __future__ import annotations

import os
import sys

from .common import Section, brief, record_failure, short_error
from .report import fmt, peer_report

FAMILY = "mlstm"
DESCRIPTION = "the mLSTM cell: kspec.ops.mlstm_chunkwise against mlstm_kernels (Triton xl_chunk) and torch"

# Bounds of issue 29 for bf16, max|x - ref| / max|ref|: forward, gradients.
FWD_TOL, BWD_TOL = 2e-2, 5e-2
CHECK_STEPS = 256  # the checked prefix of sequence (0, 0) (a step depends only on the ones before it)
TARGET = 1.3       # issue 29: >= 1.3x the best mlstm_kernels kernel, fwd and fwd+bwd
# --mlstm-quick: issue 29's speed table in under a minute (the full run took > 150 s on the H100): only
# kspec's default (algo=tc) and mlstm_kernels xl_chunk at chunk 128, these head dims at S = 4096, few reps.
QUICK_DIMS, QUICK_S, QUICK_CHUNK, QUICK_REPS, QUICK_WARMUP = ((128, 128), (128, 256), (256, 512)), 4096, 128, 10, 3


def add_arguments(p):
    p.add_argument("--mlstm-seqlens", metavar="S,...", default="4096,8192",
                   help="mlstm: sequence lengths (default 4096,8192; B = 8, NH = 8)")
    p.add_argument("--mlstm-dims", metavar="DHQKxDHHV,...", default="128x128",
                   help="mlstm: head dims (default 128x128; issue 29 also lists 128x256,256x512)")
    p.add_argument("--mlstm-chunks", metavar="L,...", default="64,128",
                   help="mlstm: kspec's chunk sizes timed (default 64,128)")
    p.add_argument("--mlstm-quick", action="store_true",
                   help=f"mlstm: kspec tc vs mlstm_kernels xl_chunk only, L={QUICK_CHUNK}, S={QUICK_S}, DH "
                        + ", ".join(f"{k}x{v}" for k, v in QUICK_DIMS) + f", {QUICK_REPS} reps, and the step table"
                        " (< 90 s on an H100)")


def flops(B, NH, S, DK, DV, kind):
    """Issue 29's one formula: per token and head 4 DHQK DHHV + 128 (DHQK + DHHV) forward, x3 with backward."""
    per = 4 * DK * DV + 128 * (DK + DV)
    return B * NH * S * per * (1 if kind == "fwd" else 3)


def min_bytes(B, NH, S, DK, DV, kind, s=2):
    """q, k, v, i, f read and h written once (bf16); fwd+bwd also reads them and dh again and writes dq, dk,
    dv, di, df (the per-step nrm and m, 8 bytes a step, left out)."""
    rows = B * NH * S
    fwd = rows * (2 * DK + DV + 2 + DV) * s
    return fwd if kind == "fwd" else fwd + rows * (2 * DK + DV + 2 + DV) * s + rows * (2 * DK + DV + 2) * s


def torch_parallel(torch, q, k, v, i, f, eps=1e-6):
    """The parallel form in torch (issue 29's formula): F = cumsum(logsigmoid(f)), logD_ts = F_t - F_s + i_s
    (s <= t), m_t = max_s logD_ts, C = s q k^T e^(logD - m), h = C v / (max(|sum_s C_ts|, e^-m) + eps).
    Memory: B NH S^2 fp32 a few times over (OOM at large S is part of the result)."""
    S, DK = q.shape[-2], q.shape[-1]
    F = torch.cumsum(torch.nn.functional.logsigmoid(f.float()), dim=-1)
    logD = F[..., :, None] - F[..., None, :] + i.float()[..., None, :]
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    logD = logD.masked_fill(~mask, float("-inf"))
    m = logD.amax(dim=-1, keepdim=True)
    C = (q.float() @ k.float().transpose(-1, -2)) * DK ** -0.5 * torch.exp(logD - m)
    n = torch.maximum(C.sum(dim=-1, keepdim=True).abs(), torch.exp(-m))
    return ((C @ v.float()) / (n + eps)).to(q.dtype)


def _inputs(torch, dev, B, NH, S, DK, DV, seed):
    g = torch.Generator(device=dev).manual_seed(seed)

    def rn(*shape, shift=0.0):
        return (torch.randn(*shape, device=dev, generator=g) + shift).to(torch.bfloat16)

    # forget gates near 3 (sigmoid ~ 0.95: memory over tens of steps), input gates N(0, 1)
    return dict(q=rn(B, NH, S, DK), k=rn(B, NH, S, DK), v=rn(B, NH, S, DV), i=rn(B, NH, S), f=rn(B, NH, S, shift=3.0))


def _reference(torch, x, dh_check):
    """Float64 h and gradients on the checked prefix of sequence (0, 0)."""
    from kspec.reference import mlstm as ref

    P = CHECK_STEPS
    a = [x[n][:1, :1, :P].double().cpu().numpy() for n in ("q", "k", "v", "i", "f")]
    h = ref.mlstm_chunkwise_fwd(*a, chunk=64)[0]
    g = ref.mlstm_chunkwise_bwd(dh_check[:1, :1, :P].double().cpu().numpy(), *a, chunk=64)
    return {"h": h, **{n: g[n] for n in ("dq", "dk", "dv", "di", "df")}}


def _max_rel(torch, got, want):
    import numpy as np

    got = got.detach()[:1, :1, :CHECK_STEPS].double().cpu().numpy()
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _peers():
    """{name: fn(q, k, v, i, f, chunk_size)} of mlstm_kernels' chunkwise Triton kernels, or a reason."""
    # triton 3.6's LLVM crashes compiling the xl_chunk kernel; this works around it (costs 1-3%)
    os.environ.setdefault("DISABLE_LLVM_OPT", "1")
    try:
        from mlstm_kernels.torch.chunkwise import mlstm_chunkwise__limit_chunk, mlstm_chunkwise__xl_chunk
    except Exception as e:  # noqa: BLE001
        return {}, f"mlstm_kernels not importable ({brief(str(e))})"
    return {"xl_chunk": mlstm_chunkwise__xl_chunk, "limit_chunk": mlstm_chunkwise__limit_chunk}, None


def variants(ctx, chunks, peers, quick=False):
    """[(name, impl, fn(q, k, v, i, f) -> h)]; quick: kspec and xl_chunk at QUICK_CHUNK only."""
    torch, K = ctx.torch, ctx.kspec.ops
    out = [(f"kspec chunkwise L={L}", "kspec",
            lambda q, k, v, i, f, L=L: K.mlstm_chunkwise(q, k, v, i, f, chunk_size=L)) for L in chunks]
    if quick:
        if "xl_chunk" in peers:
            out.append((f"mlstm_kernels xl_chunk L={QUICK_CHUNK}", "peer",
                        lambda q, k, v, i, f: peers["xl_chunk"](q=q, k=k, v=v, i=i, f=f, chunk_size=QUICK_CHUNK)))
        return out
    for L in (64, 128, 256):
        if "xl_chunk" in peers:
            out.append((f"mlstm_kernels xl_chunk L={L}", "peer",
                        lambda q, k, v, i, f, L=L: peers["xl_chunk"](q=q, k=k, v=v, i=i, f=f, chunk_size=L)))
    if "limit_chunk" in peers:
        out.append(("mlstm_kernels limit_chunk L=64", "peer",
                    lambda q, k, v, i, f: peers["limit_chunk"](q=q, k=k, v=v, i=i, f=f, chunk_size=64)))
    out.append(("torch eager (parallel)", "peer", lambda q, k, v, i, f: torch_parallel(torch, q, k, v, i, f)))
    compiled = torch.compile(lambda q, k, v, i, f: torch_parallel(torch, q, k, v, i, f), dynamic=False)
    out.append(("torch.compile (parallel)", "peer", compiled))
    return out


def run(ctx):
    torch = ctx.torch
    seqlens = [int(s) for s in ctx.args.mlstm_seqlens.split(",")]
    dims = [tuple(int(d) for d in s.split("x")) for s in ctx.args.mlstm_dims.split(",")]
    chunks = [int(c) for c in ctx.args.mlstm_chunks.split(",")]
    B, NH = 8, 8
    quick = getattr(ctx.args, "mlstm_quick", False)
    if quick:
        seqlens, dims, chunks = [QUICK_S], list(QUICK_DIMS), [QUICK_CHUNK]
    elif ctx.args.quick:
        seqlens, B = [1024], 2
    peers, why = _peers()
    if why:
        print(f"bench: mlstm: {why}", file=sys.stderr)
    rows = []
    for DK, DV in dims:
        for S in seqlens:
            x = _inputs(torch, ctx.dev, B, NH, S, DK, DV, ctx.args.seed + S)
            dh = torch.randn(B, NH, S, DV, device=ctx.dev).to(torch.bfloat16)
            dh_check = torch.zeros_like(dh)  # dh on the checked prefix only: its gradients are the prefix's
            dh_check[:1, :1, :CHECK_STEPS] = dh[:1, :1, :CHECK_STEPS]
            ref = _reference(torch, x, dh_check)
            leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
            shape = f"{B}x{NH}x{S} {DK}x{DV}"
            for name, impl, fn in variants(ctx, chunks, peers, quick):
                def fwd(fn=fn, x=x):
                    return fn(x["q"], x["k"], x["v"], x["i"], x["f"])

                def prep(leaves=leaves):
                    for t in leaves.values():
                        t.grad = None

                def fwdbwd(fn=fn, cot=dh, leaves=leaves):
                    h = fn(leaves["q"], leaves["k"], leaves["v"], leaves["i"], leaves["f"])
                    h.backward(cot)
                    return h

                for kind, step in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
                    row = {"family": "mlstm", "shape": shape, "B": B, "NH": NH, "S": S, "DHQK": DK, "DHHV": DV,
                           "variant": name, "impl": impl, "kind": kind, "flops": flops(B, NH, S, DK, DV, kind),
                           "bytes": min_bytes(B, NH, S, DK, DV, kind), "status": ""}
                    if ctx.skipped(name):
                        row["status"] = "skipped"
                        rows.append(row)
                        continue
                    try:
                        row.update(_validate_and_time(ctx, torch, kind, fwd, fwdbwd, prep, leaves, dh_check, ref,
                                                      impl, step, quick))
                    except Exception as e:  # noqa: BLE001  (a peer's OOM or compile failure is a result)
                        record_failure(row, e, ctx.args.verbose, torch)
                    rows.append(row)
                    print(f"bench: mlstm {shape} {name} {kind}: {row['status']}", file=sys.stderr, flush=True)
            del x, dh, dh_check, leaves
            torch.cuda.empty_cache()
    _ratios(rows)
    data, sections = _report(ctx, rows, why)
    step_rows = run_step(ctx, peers_step())
    data["step"] = step_rows
    return data, sections + [_step_section(step_rows)]


# ---- the decoding step ----

STEP_BATCHES = (1, 8, 64)
STEP_BLOCK = "algo=block,threads=256,cols=16"  # the step's first kernel (the default is algo=split)


def peers_step():
    """mlstm_kernels' Triton step kernel, or None."""
    os.environ.setdefault("DISABLE_LLVM_OPT", "1")
    try:
        from mlstm_kernels.torch.recurrent.triton_step import mlstm_recurrent_step__triton_fw
    except Exception:  # noqa: BLE001  (absent: the rows say so)
        return None

    def step(q, k, v, i, f, c, n, m):
        return mlstm_recurrent_step__triton_fw(matC_old=c, vecN_old=n, scaM_old=m, vecQ=q, vecK=k, vecV=v, scaI=i,
                                               scaF=f, eps=1e-6)

    return step


def run_step(ctx, peer):
    """mlstm.step at B in STEP_BATCHES, NH = 8, DH = 128, bf16, states fp32: µs per step (one token of each
    sequence), kspec's in-place step against mlstm_kernels' Triton step; h and the new C checked against the
    float64 recurrence first."""
    import numpy as np
    from kspec.reference import mlstm as ref

    torch, K = ctx.torch, ctx.kspec.ops
    NH, DK, DV = 8, 128, 128
    rows = []
    for B in STEP_BATCHES:
        g = torch.Generator(device=ctx.dev).manual_seed(ctx.args.seed + B)
        rn = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=ctx.dev, generator=g).to(dt)  # noqa: E731
        q, k, v, i, f = rn(B, NH, DK), rn(B, NH, DK), rn(B, NH, DV), rn(B, NH, 1), rn(B, NH, 1) + 3
        C, n, m = rn(B, NH, DK, DV, dt=torch.float32), rn(B, NH, DK, dt=torch.float32).abs(), rn(B, NH, 1,
                                                                                                dt=torch.float32)
        a = [t.double().cpu().numpy() for t in (q, k, v)]
        want_h, _, _, (want_C, _, _) = ref.mlstm_recurrent_fwd(
            *(x[:, :, None] for x in a), i.double().cpu().numpy(), f.double().cpu().numpy(),
            C.double().cpu().numpy(), n.double().cpu().numpy(), m.double().cpu().numpy()[..., 0])
        def block(s):  # the first kernel, one CTA a sequence (mlstm.step's algo=block), beside the default
            h = torch.empty_like(v)
            ctx.kspec.call("mlstm.step", q, k, v, i, f, *s, eps=1e-6, out=(h, *s), config=STEP_BLOCK)
            return h, s

        impls = [("kspec mlstm_step (in place)", lambda s: K.mlstm_step(q, k, v, i, f, *s, inplace=True)),
                 ("kspec mlstm.step algo=block (in place)", block)]
        if peer is not None:
            impls.append(("mlstm_kernels triton step", lambda s: peer(q, k, v, i, f, *s)))
        for name, fn in impls:
            row = {"family": "mlstm", "B": B, "variant": name, "kind": "step", "status": ""}
            try:
                states = (C.clone(), n.clone(), m.clone())
                h, (C2, _, _) = fn(states)
                torch.cuda.synchronize()
                errs = [float(np.abs(got.double().cpu().numpy() - w).max() / np.abs(w).max())
                        for got, w in ((h, want_h[:, :, 0]), (C2, want_C))]
                row["max_error"] = max(errs)
                row["status"] = "ok" if row["max_error"] <= FWD_TOL else "INVALID"
                states = (C.clone(), n.clone(), m.clone())
                row.update(ctx.timer.time(lambda fn=fn, states=states: fn(states)))
            except Exception as e:  # noqa: BLE001
                row["status"] = "error"
                row["error"] = short_error(e)
            rows.append(row)
    return rows


def _step_section(rows):
    cols = [("B", "B"), ("variant", "variant"),
            ("gpu µs", lambda r: fmt(r["gpu_ms"] * 1e3 if "gpu_ms" in r else None, ".1f")),
            ("ev µs", lambda r: fmt(r["ev_ms"] * 1e3 if "ev_ms" in r else None, ".1f")),
            ("host µs", lambda r: fmt(r.get("host_us"), ".1f")),
            ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    notes = ["one decoding step (a token of every sequence), NH = 8, DH = 128, q/k/v bf16, states fp32; h and C'"
             " checked against the float64 recurrence first; kspec updates C, n, m in place, mlstm_kernels returns"
             " new states."]
    if not any(r["variant"].startswith("mlstm_kernels") for r in rows):
        notes.append("peer absent: mlstm_kernels' triton step not importable")
    return Section("mlstm.step: µs per step", cols, rows, notes)


def _validate_and_time(ctx, torch, kind, fwd, fwdbwd, prep, leaves, dh_check, ref, impl, step, quick=False):
    out = {}
    if kind == "fwd":
        errs = {"h": _max_rel(torch, fwd(), ref["h"])}
        tol = FWD_TOL
    else:
        prep()
        h = fwdbwd(cot=dh_check)
        errs = {"h": _max_rel(torch, h, ref["h"])}
        for n in ("q", "k", "v", "i", "f"):
            g = leaves[n].grad
            errs["d" + n] = float("inf") if g is None else _max_rel(torch, g, ref["d" + n])
        tol = BWD_TOL
        del h
    torch.cuda.synchronize()
    out["errors"] = errs
    out["max_error"] = max(errs.values())
    out["valid"] = out["max_error"] <= tol
    out["status"] = "ok" if out["valid"] else "INVALID"
    if out["valid"] or impl != "kspec" or ctx.args.time_invalid:
        t = ctx.timer.time(step, prep if kind != "fwd" else None,
                           **(dict(reps=QUICK_REPS, warmup=QUICK_WARMUP) if quick else {}))
        out.update(t)
    return out


def _ratios(rows):
    """kspec's best chunk size per (shape, kind) against every row: this row's time / kspec's (> 1: kspec
    faster); and against the best mlstm_kernels kernel."""
    for r in rows:
        same = [k for k in rows if k["shape"] == r["shape"] and k["kind"] == r["kind"] and "gpu_ms" in k]
        best_k = min((k for k in same if k["impl"] == "kspec"), key=lambda k: k["gpu_ms"], default=None)
        if best_k is not None and "gpu_ms" in r:
            r["kspec_speedup_gpu"] = r["gpu_ms"] / best_k["gpu_ms"]
            r["kspec_speedup_ev"] = r["ev_ms"] / best_k["ev_ms"]
        if "gpu_ms" in r:
            r["tflops"] = r["flops"] / (r["gpu_ms"] * 1e-3) / 1e12
            r["tokens_per_s"] = r["B"] * r["S"] / (r["gpu_ms"] * 1e-3)


def _report(ctx, rows, why):
    cols = [
        ("shape (BxNHxS DH)", "shape"), ("variant", "variant"), ("kind", "kind"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
        ("TFLOP/s", lambda r: fmt(r.get("tflops"), ".1f")),
        ("Mtok/s", lambda r: fmt(r["tokens_per_s"] / 1e6 if "tokens_per_s" in r else None, ".2f")),
    ]  # then report.PEER_COLUMNS (speed-up, error, status)
    notes = [
        "gpu: spin queued before the start event (pure GPU time); ev: plain events (host launch time included);"
        " kspec ×: this row's time / kspec's best chunk size's (> 1: kspec faster).",
        "TFLOP/s by issue 29's formula: per token and head 4·DHQK·DHHV + 128·(DHQK+DHHV) forward, ×3 with"
        " backward; Mtok/s = B·S / t.",
        f"validation: h and every gradient of sequence (0, 0), steps < {CHECK_STEPS} (dh zero elsewhere), against"
        f" the float64 reference (bounds {FWD_TOL:g} / {BWD_TOL:g}, max|err| / max|ref|) before timing.",
        "mlstm_kernels 2.0.6 under DISABLE_LLVM_OPT=1 (triton 3.6's LLVM crashes on xl_chunk otherwise); its"
        " backward holds n and m constant, as kspec's. Anchor (peers.md, H100): xl_chunk L=128, 8x8, DH 128:"
        " S=4096 0.514 / 1.624 ms, S=8192 0.994 / 3.150 ms.",
    ]
    return peer_report("mlstm: the mLSTM cell, bf16, B=8, NH=8", cols, rows, notes, why, targets(rows))


def targets(rows) -> list:
    lines = [f"targets (issue 29): kspec >= {TARGET}x the best mlstm_kernels kernel:"]
    for shape in sorted({r["shape"] for r in rows}):
        for kind in ("fwd", "fwd+bwd"):
            same = [r for r in rows if r["shape"] == shape and r["kind"] == kind and "gpu_ms" in r]
            k = min((r for r in same if r["impl"] == "kspec"), key=lambda r: r["gpu_ms"], default=None)
            p = min((r for r in same if r["variant"].startswith("mlstm_kernels")), key=lambda r: r["gpu_ms"],
                    default=None)
            if k is None or p is None:
                lines.append(f"  {shape} {kind}: — (kspec {'timed' if k else 'absent'}, mlstm_kernels "
                             f"{'timed' if p else 'absent'})")
                continue
            ratio = p["gpu_ms"] / k["gpu_ms"]
            lines.append(f"  {shape} {kind}: {k['variant']} {k['gpu_ms']:.3f} ms vs {p['variant']} {p['gpu_ms']:.3f}"
                         f" ms: {ratio:.2f}x {'ok' if ratio >= TARGET else 'MISSED'}")
    return lines

