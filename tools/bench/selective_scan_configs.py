"""The selective_scan_configs sweep: every config of the scan's forward or backward at one shape."""
from __future__ import annotations

import re
import sys

from .common import Section, brief, short_error
from .report import fmt
from .selective_scan import SFU_EX2_PER_S, scan_check, scan_inputs
from .timing import round_ratio


FAMILY = "selective_scan_configs"
DESCRIPTION = "every config of the scan's forward or backward at one shape (a sweep)"
IN_ALL = False  # a sweep, run on request


def add_arguments(p):
    p.add_argument("--scan-op", choices=("fwd", "bwd"), default="fwd", help="selective_scan_configs: the op")
    p.add_argument("--scan-shape", default="8x2048x2048", metavar="BxDxL[,BxDxL...]",
                   help="selective_scan_configs: the shape, or several (comma-separated), each with every config")
    p.add_argument("--scan-own-states", action="store_true",
                   help="selective_scan_configs: the backward without the forward's states (it makes its own)")
    p.add_argument("--scan-config", action="append", metavar="CONFIG",
                   help="selective_scan_configs: a config to time (repeatable; default: a forward sweep)")


def _peer():
    """mamba_ssm's selective_scan_fn where it is built (its forward is timed beside the configs), else None."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn  # torch imported first
        return selective_scan_fn
    except Exception as e:  # noqa: BLE001
        print(f"bench: selective_scan_configs: mamba_ssm not importable ({brief(str(e))})", file=sys.stderr)
        return None


def run(ctx):
    """selective_scan.fwd or .bwd (--scan-op) at one shape or several (--scan-shape BxDxL[,...], default
    8x2048x2048) under each config of a list (--scan-config, repeatable; default: a forward sweep), the
    heuristic's choice timed too and marked, and for the forward mamba_ssm's selective_scan_fn (no grad) where
    it is built: which algorithm, block shape and segment count to prefer, old and new configs in one process.
    Raw kspec.call, no autograd: the forward without states (inference), the backward with the forward's
    states (training; --scan-own-states: without, so it makes its own). Each config's outputs are compared with
    the heuristic's before it is timed (the forward's out prefix also with the float64 reference)."""
    shapes = ([(2, 1024, 1024)] if ctx.args.quick else
              [tuple(int(v) for v in s.split("x")) for s in ctx.args.scan_shape.split(",")])
    peer = _peer() if ctx.args.scan_op == "fwd" else None
    rows, sections = [], []
    for b, d, t in shapes:
        shape_rows = _run_shape(ctx, b, d, t, peer)
        rows += shape_rows
        sections.append(_section(ctx.args.scan_op, b, d, t, shape_rows))
    return {"results": rows}, sections


def _run_shape(ctx, b, d, t, peer):
    torch = ctx.torch
    kspec = ctx.kspec
    op = f"selective_scan.{ctx.args.scan_op}"
    n = 16
    x = scan_inputs(torch, ctx.dev, b, d, t, n, ctx.args.seed)
    fwd_args = (x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], None)
    states = None
    if ctx.args.scan_op == "bwd" and not ctx.args.scan_own_states:
        states = torch.empty(b, d, -(-t // 16), n, device=ctx.dev)
        kspec.call("selective_scan.fwd", *fwd_args, delta_softplus=True,
                   out=(torch.empty_like(x["u"]), torch.empty(b, d, n, device=ctx.dev), states))
    args = fwd_args if ctx.args.scan_op == "fwd" else (torch.randn_like(x["u"]),) + fwd_args + (None, states)
    configs = list(ctx.args.scan_config or [])
    if not configs:
        configs = ["algo=warp,warps=4,items=8,lanes=1,chunk=32,segs=1", "algo=warp,warps=2,items=8,lanes=1,chunk=32,segs=1"]
        for warps in (2, 4, 8):
            for lanes in (1, 2, 4):
                for chunk in (32, 64, 128):
                    configs.append(f"algo=sequential,warps={warps},items=4,lanes={lanes},chunk={chunk},segs=1")
    try:  # the heuristic's config, as explain() prints it
        m = re.search(r"algo=[0-9a-z=,]+", str(kspec.explain(op, *args, delta_softplus=True)))
        heur = m.group(0) if m else ""
    except Exception:  # noqa: BLE001
        heur = ""
    if heur and heur not in configs:
        configs.insert(0, heur)
    ref_out = [o.float() for o in kspec.call(op, *args, delta_softplus=True) if o is not None]
    rows, steps = [], []
    elems = b * d * t
    ex2_floor_ms = elems * n * (1 if ctx.args.scan_op == "fwd" else 2) / SFU_EX2_PER_S * 1e3
    for cfg in configs:
        row = {"family": "selective_scan_configs", "op": op, "shape": f"{b}x{d}x{t}", "config": cfg,
               "heuristic": cfg == heur, "status": ""}
        try:
            step = lambda cfg=cfg: kspec.call(op, *args, config=cfg, delta_softplus=True)  # noqa: E731
            outs = [o.float() for o in step() if o is not None]
            row["vs_heuristic"] = max(float((o - r).norm() / r.norm().clamp_min(1e-30)) for o, r in zip(outs, ref_out))
            ok = row["vs_heuristic"] <= 1e-2
            if ctx.args.scan_op == "fwd":
                row["max_error"] = scan_check(torch, x, outs[0][:1, :4, :512].cpu())
                ok = ok and row["max_error"] <= 2e-2
            row["status"] = "ok" if ok else "INVALID"
            if ok:
                steps.append((row, step))
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["error"] = short_error(e)
        rows.append(row)
    if peer is not None:
        row = {"family": "selective_scan_configs", "op": op, "shape": f"{b}x{d}x{t}", "config": "mamba_ssm",
               "heuristic": False, "status": ""}
        try:
            step = lambda a=x: peer(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"],  # noqa: E731
                                    a["delta_bias"], True)
            row["max_error"] = scan_check(torch, x, step().float()[:1, :4, :512].cpu())
            row["status"] = "ok" if row["max_error"] <= 2e-2 else "INVALID"
            steps.append((row, step))
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["error"] = short_error(e)
        rows.append(row)
    # Every config and the peer interleaved (rounds, each in turn): a few % between configs outlasts the drift
    # of one stretch of the run. The heuristic's config, where timed, is first: the base of x_gpu.
    steps.sort(key=lambda rs: not rs[0]["heuristic"])
    try:
        timed = ctx.timer.time_rounds([s for _, s in steps]) if steps else []
    except Exception as e:  # noqa: BLE001
        timed = []
        for r, _ in steps:
            r["status"] = "error"
            r["error"] = short_error(e)
    for (r, _), t_ in zip(steps, timed):
        r.update(t_)
        r["ex2_floor_ms"] = ex2_floor_ms
        if steps[0][0]["heuristic"]:
            r["heuristic_x"] = 1.0 / t_["x_gpu"]  # the heuristic's gpu time over this config's, round by round
    peer_t = next((t_ for (r, _), t_ in zip(steps, timed) if r["config"] == "mamba_ssm"), None)
    for (r, _), t_ in zip(steps, timed):
        if peer_t is not None:
            r["mamba_x"] = round_ratio(peer_t, t_)
    for r in rows:
        print(f"bench: selective_scan_configs {op} {b}x{d}x{t} {r['config']}: {r['status']} {r.get('gpu_ms', '')}",
              file=sys.stderr, flush=True)
    return rows


def _section(op_name, b, d, t, rows):
    cols = [("config", "config"), ("heuristic", lambda r: "*" if r["heuristic"] else ""),
            ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".4f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".4f")),
            ("ex2 floor ms", lambda r: fmt(r.get("ex2_floor_ms"), ".3f")),
            ("heuristic ÷ this (gpu)", lambda r: fmt(r.get("heuristic_x"), ".3f")),
            ("mamba_ssm ÷ this (gpu)", lambda r: fmt(r.get("mamba_x"), ".2f")),
            ("vs heuristic", lambda r: fmt(r.get("vs_heuristic"), ".1e")),
            ("rel err (prefix)", lambda r: fmt(r.get("max_error"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    notes = ["ex2 floor: one ex2 per step and state for the forward, two for the backward (its recompute from"
             " the forward's states and the adjoint; three without the states, and one more with segments).",
             "mamba_ssm: its selective_scan_fn forward (no grad) on the same inputs, where it is built; the"
             " column is its gpu time over each config's (issue 33 asks >= 1.5).",
             "timing: every config and mamba_ssm interleaved, 10 rounds, each in turn (round r starting at the r-th);"
             " ms the median of the rounds' medians, the ÷ columns the median of the rounds' ratios."]
    return Section(f"selective_scan.{op_name} configs, bf16, {b}x{d}x{t}, dstate 16", cols, rows, notes)
