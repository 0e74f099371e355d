"""The adamw benchmark: one optimizer step over a GPT-350M-like parameter list."""
from __future__ import annotations

import math
import sys
import traceback

from .common import TOLERANCE, Section, rel_error, short_error, to_f64
from .report import fmt

FAMILY = "adamw"
DESCRIPTION = "one AdamW step over GPT-350M's parameters against torch's fused and foreach AdamW"


ADAMW_MIN_PCT = 92.0  # peers.md: ≤ 3.6 ms for 353.6 M fp32 parameters, i.e. ≥ 92 % of 3.0 TB/s
ADAMW_HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def gpt350m_shapes(vocab=50304, d=1024, layers=24, positions=1024) -> list:
    """GPT-2-medium-like parameter shapes (d 1024, 24 layers, vocabulary padded to 50304, 1024 positions,
    bias-free LayerNorms): token and position embeddings; per layer ln1.w, qkv (3d×d) + bias, attention
    projection (d×d) + bias, ln2.w, MLP up (4d×d) + bias, down (d×4d) + bias; a final LayerNorm weight.
    243 tensors, 354.8 M parameters (peers.md's torch figure was for 353.6 M in 243 tensors; its exact
    shapes are not recorded, the torch peers here run on this same list)."""
    shapes = [(vocab, d), (positions, d)]
    for _ in range(layers):
        shapes += [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,)]


# Bytes each parameter's step must move (the floor): fp32 params: param r+w 8, grad r 4, exp_avg r+w 8,
# exp_avg_sq r+w 8 = 28. bf16 params with an fp32 master: master r+w 8, bf16 param w 2, bf16 grad r 2,
# moments 16 = 28. What other variants move is listed with them.
ADAMW_FLOOR_BYTES_PER_PARAM = 28


def _adamw_check_items(shapes) -> list:
    """(tensor index, slice of its flattened elements) compared with the float64 reference after the first
    step: the embedding's first and last 65537 elements (the update is elementwise without clipping), a
    LayerNorm weight, a qkv weight and its bias, the final LayerNorm."""
    n0 = math.prod(shapes[0])
    e = min(65537, n0)
    return [(0, slice(0, e)), (0, slice(n0 - e, n0)), (2, slice(None)), (3, slice(None)), (4, slice(None)),
            (len(shapes) - 1, slice(None))]


def _adamw_variants(ctx, group):
    torch = ctx.torch
    kspec = ctx.kspec
    h = ADAMW_HYPER
    out = []
    if group == "fp32":
        def kspec_opt(ps):
            return kspec.optim.AdamW(ps, **h)

        def raw(ps):
            # The op itself, lists built once: what the optimizer adds on the host shows against this.
            grads = [p.grad for p in ps]
            m = [torch.zeros_like(p) for p in ps]
            v = [torch.zeros_like(p) for p in ps]
            pos = {id(p): i for i, p in enumerate(ps)}  # not ps.index: == on tensors is elementwise
            kw = dict(lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                      weight_decay=h["weight_decay"], step=1)

            def step():
                kspec.call("adamw", ps, grads, m, v, None, None, None, out=(None, None), **kw)

            return step, lambda p: {"param": p, "exp_avg": m[pos[id(p)]], "exp_avg_sq": v[pos[id(p)]]}

        out += [("kspec.optim.AdamW", "kspec", kspec_opt, 28, "one launch for all tensors"),
                ("kspec.call('adamw')", "kspec", raw, 28, "the raw op, lists built once"),
                ("torch AdamW(fused=True)", "peer", lambda ps: torch.optim.AdamW(ps, fused=True, **h), 28, ""),
                ("torch AdamW(foreach=True)", "peer", lambda ps: torch.optim.AdamW(ps, foreach=True, **h), 28, "")]
    else:
        def master_peer(ps):
            # The torch equivalent of an fp32 master copy: fused AdamW on fp32 copies, gradients cast in,
            # parameters cast back (grad r 2 + w 4, step 28, master r 4 + param w 2 = 40 bytes/param).
            masters = [torch.nn.Parameter(p.detach().float()) for p in ps]
            for mp in masters:
                mp.grad = torch.empty_like(mp)
            opt = torch.optim.AdamW(masters, fused=True, **h)
            grads = [p.grad for p in ps]
            pos = {id(p): i for i, p in enumerate(ps)}

            @torch.no_grad()
            def step():
                torch._foreach_copy_([mp.grad for mp in masters], grads)
                opt.step()
                torch._foreach_copy_(ps, masters)

            return step, lambda p: {"param": masters[pos[id(p)]], **opt.state[masters[pos[id(p)]]]}

        out += [("kspec.optim.AdamW (fp32 master)", "kspec", lambda ps: kspec.optim.AdamW(ps, **h), 28,
                 "state['master'] fp32, bf16 params written from it"),
                ("torch fused on fp32 masters + casts", "peer", master_peer, 40,
                 "_foreach_copy_ grads in, AdamW(fused=True), _foreach_copy_ params out"),
                ("torch AdamW(fused=True), bf16 state", "peer",
                 lambda ps: torch.optim.AdamW(ps, fused=True, **h), 14,
                 "no master: bf16 params and moments (less precise; 14 bytes/param)")]
    return out


def _adamw_group(ctx, group, shapes, seed) -> list:
    import numpy as np

    torch = ctx.torch
    from kspec.reference import adamw as ref

    dt = torch.float32 if group == "fp32" else torch.bfloat16
    g = torch.Generator(device=ctx.dev).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.randn(*s, device=ctx.dev, generator=g) * (0.02 if len(s) == 2 else 0.1)
        params.append(torch.nn.Parameter(p.to(dt)))
    for p in params:
        p.grad = (torch.randn(p.shape, device=ctx.dev, generator=g) * 1e-2).to(dt)
    n_params = sum(p.numel() for p in params)
    items = _adamw_check_items(shapes)
    floor_ms = n_params * ADAMW_FLOOR_BYTES_PER_PARAM / (ctx.args.peak_tbps * 1e12) * 1e3
    rows = []
    for name, impl, make, bpp, note in _adamw_variants(ctx, group):
        row = {"family": "adamw", "group": group, "params": n_params, "tensors": len(params), "variant": name,
               "impl": impl, "note": note, "bytes_per_param": bpp, "bytes": bpp * n_params, "floor_ms": floor_ms,
               "status": "", "errors": {}}
        rows.append(row)
        if ctx.skipped(name):
            row["status"] = "skipped"
            continue
        opt = step = state_of = made = st = None
        try:
            # Before the first step: the checked slices of params (a master copy starts as the bf16
            # param) and grads, fresh zero moments; one step; then the same step in float64.
            p0 = [to_f64(params[i].detach().reshape(-1)[s]) for i, s in items]
            g0 = [to_f64(params[i].grad.reshape(-1)[s]) for i, s in items]
            made = make(params)
            if isinstance(made, tuple):
                step, state_of = made
            else:
                opt = made
                step = opt.step

                def state_of(p, opt=opt):
                    st = opt.state[p]
                    return {"param": st.get("master", p), **st}
            step()
            torch.cuda.synchronize()
            m0 = [np.zeros_like(x) for x in p0]
            v0 = [np.zeros_like(x) for x in p0]
            hp = ADAMW_HYPER
            ref.adamw_step(p0, g0, m0, v0, lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                           weight_decay=hp["weight_decay"], step=1)
            errs, tols = row["errors"], {}
            # fp32 numbers (params, master copies, moments) to fp32's tolerance; bf16 numbers (a bf16
            # parameter, the moments of a bf16-state peer) to bf16's.
            state_tol = TOLERANCE["bfloat16"] if "bf16 state" in name else TOLERANCE["float32"]

            def compare(key, got, want, t):
                errs[key] = max(errs.get(key, 0.0), rel_error(got, want))
                tols[key] = t

            for j, (i, s) in enumerate(items):
                st = state_of(params[i])
                compare(f"param[{i}]", to_f64(st["param"].detach().reshape(-1)[s]), p0[j], state_tol)
                compare(f"exp_avg[{i}]", to_f64(st["exp_avg"].reshape(-1)[s]), m0[j], state_tol)
                compare(f"exp_avg_sq[{i}]", to_f64(st["exp_avg_sq"].reshape(-1)[s]), v0[j], state_tol)
                if dt != torch.float32:
                    compare(f"bf16 param[{i}]", to_f64(params[i].detach().reshape(-1)[s]), p0[j], TOLERANCE["bfloat16"])
            row["max_error"] = max(errs.values())
            row["tolerances"] = tols
            row["valid"] = all(errs[k] <= tols[k] for k in errs)
            row["status"] = "ok" if row["valid"] else "INVALID"
            if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                t = ctx.timer.time(step)
                row.update(t)
                row["gbps"] = row["bytes"] / (t["gpu_ms"] * 1e6)
                row["pct_of_peak"] = 100.0 * row["bytes"] / (t["gpu_ms"] * 1e-3) / (ctx.args.peak_tbps * 1e12)
                row["floor_over_gpu"] = floor_ms / t["gpu_ms"]
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["error"] = short_error(e)
            if ctx.args.verbose:
                traceback.print_exc()
        print(f"bench: adamw {group} {name}: {row['status']}", file=sys.stderr, flush=True)
        del opt, step, state_of, made, st  # the optimizer's state goes before the next variant's
        torch.cuda.empty_cache()
    for r in rows:
        base = next((b for b in rows if b["impl"] == "kspec" and b["variant"].startswith("kspec.optim")
                     and "gpu_ms" in b), None)
        if base and "gpu_ms" in r:
            r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]
            r["kspec_speedup_ev"] = r["ev_ms"] / base["ev_ms"]
    del params
    torch.cuda.empty_cache()
    return rows


def run(ctx):
    ctx.torch  # noqa: B018  (no GPU: a clear message before any work)
    shapes = gpt350m_shapes(vocab=4096, d=256, layers=4, positions=256) if ctx.args.quick else gpt350m_shapes()
    n = sum(math.prod(s) for s in shapes)
    print(f"bench: adamw: {len(shapes)} tensors, {n:,} parameters ({n / 1e6:.1f} M)", file=sys.stderr, flush=True)
    rows = []
    for i, group in enumerate(("fp32", "bf16")):
        rows += _adamw_group(ctx, group, shapes, ctx.args.seed + 100 + i)
    peak = ctx.args.peak_tbps
    cols = [
        ("params", lambda r: f"{r['group']}: {r['params'] / 1e6:.1f} M in {r['tensors']}"),
        ("variant", "variant"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
        ("host µs", lambda r: fmt(r.get("host_us"), ".0f")),
        ("B/param", "bytes_per_param"),
        ("GB/s", lambda r: fmt(r.get("gbps"), ".0f")),
        (f"% of {peak:g} TB/s", lambda r: fmt(r.get("pct_of_peak"), ".0f")),
        ("floor ms", lambda r: fmt(r.get("floor_ms"), ".3f")),
        ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
         if "kspec_speedup_gpu" in r else "—"),
        ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = [
        f"one optimizer step, lr {ADAMW_HYPER['lr']}, betas {ADAMW_HYPER['betas']}, weight decay"
        f" {ADAMW_HYPER['weight_decay']}; floor: {ADAMW_FLOOR_BYTES_PER_PARAM} bytes/param (fp32: param r+w,"
        " grad r, exp_avg r+w, exp_avg_sq r+w; bf16: fp32 master r+w, bf16 param w, bf16 grad r, moments)"
        f" at {peak:g} TB/s; GB/s and % on each variant's own bytes (B/param).",
        "validation: one step from zero moments on the embedding's first/last 65537 elements, a LayerNorm"
        " weight, a qkv weight and bias, the final LayerNorm, against kspec.reference.adamw (float64) before"
        " timing; kspec ×: this variant's time / kspec.optim.AdamW's, same group (> 1: kspec faster).",
    ]
    notes += adamw_targets(rows)
    return {"results": rows, "shapes": [list(s) for s in shapes], "params": n}, \
        [Section("adamw: one step over GPT-350M-like parameters", cols, rows, notes)]


def adamw_targets(rows) -> list:
    lines = ["targets (peers.md: torch fused 3.768 ms = 87.6 % for 353.6 M fp32; kspec ≤ 3.6 ms, "
             f"≥ {ADAMW_MIN_PCT:g} %):"]
    for r in rows:
        if not r["variant"].startswith("kspec.optim") or "gpu_ms" not in r:
            continue
        ok = r["pct_of_peak"] >= ADAMW_MIN_PCT
        line = (f"  {r['group']} kspec.optim.AdamW: {r['gpu_ms']:.3f} ms gpu ({r['ev_ms']:.3f} ev), "
                f"{r['pct_of_peak']:.1f} % (≥ {ADAMW_MIN_PCT:g} %) {'ok' if ok else 'MISSED'}")
        peer = next((p for p in rows if p["group"] == r["group"] and p["impl"] == "peer" and "gpu_ms" in p), None)
        if peer:
            line += f"; × {peer['variant']} {peer['gpu_ms'] / r['gpu_ms']:.2f}"
        lines.append(line)
    return lines
