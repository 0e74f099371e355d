"""The selective_scan benchmark: the Mamba S6 scan, bf16, variable B/C (one group), D, z, delta_bias,
softplus, dstate 16, against mamba_ssm."""
from __future__ import annotations

import sys
import traceback

from .common import Section, brief, rel_error, short_error
from .report import fmt
from .scan_floor import NoopScan as _NoopScan  # the fwd+bwd rows' floor


FAMILY = "selective_scan"
DESCRIPTION = "the Mamba S6 scan against mamba_ssm's selective_scan_fn"
NEEDS_BUILD = "mamba"  # the peer tools/gpu/check.sh builds from source (build_mamba.sh) while kspec builds


def add_arguments(p):
    p.add_argument("--scan-shapes", metavar="BxDxL,...", help="selective_scan: these shapes instead of the default four"
                   " (the small ones of the outside test: 4x1536x1000,2x4096x333,1x2048x512,16x768x256,8x2560x1024)")
    p.add_argument("--scan-kind", choices=("fwd", "fwd+bwd", "both"), default="both",
                   help="selective_scan: the forward alone, the training step, or both (default)")


# Floors. Bytes: u, delta, z read and out written once (B, C: 2 * batch * dstate * seqlen more), fwd+bwd
# adds dout, du, ddelta, dz and the forward's reads again. Exponentials: one ex2 per (b, d, t, n) in the
# forward, three in fwd+bwd (the forward, the backward's recompute and its adjoint: kspec's with the
# forward's states every 16 steps, four with segments; without them its backward does three itself, five
# with segments; mamba_ssm's forward saves x and its backward does one); the SFU does 16 ex2 per SM and
# clock: 16 * 132 * 1.755e9 = 3.71e12 per second on the H100.
SFU_EX2_PER_S = 16 * 132 * 1.755e9


def scan_inputs(torch, dev, b, d, t, n, seed):
    g = torch.Generator(device=dev).manual_seed(seed)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    return dict(u=rn(b, d, t), delta=rn(b, d, t) * 0.5 - 1.0, A=-(0.25 + rn(d, n, dtype=torch.float32).abs()),
                B=rn(b, 1, n, t), C=rn(b, 1, n, t), D=rn(d, dtype=torch.float32), z=rn(b, d, t),
                delta_bias=rn(d, dtype=torch.float32) * 0.1)


def scan_check(torch, x, out, channels=4, steps=512):
    """out[0, :channels, :steps] against the float64 reference (its prefix needs only those steps)."""
    from kspec.reference import selective_scan as ref

    sl = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    c, s = channels, steps
    yr, _ = ref.selective_scan_fwd(sl(x["u"][:1, :c, :s]), sl(x["delta"][:1, :c, :s]), sl(x["A"][:c]),
                                   sl(x["B"][:1, :, :, :s]), sl(x["C"][:1, :, :, :s]), sl(x["D"][:c]),
                                   sl(x["z"][:1, :c, :s]), sl(x["delta_bias"][:c]), True)
    return rel_error(out[:1, :c, :s], torch.from_numpy(yr))


FLOOR = "floor: no-op autograd.Function"
FLOOR_CPP = "floor: no-op C++ node"


def _cpp_floor():
    """kspec._torch_ext.noop_grad (an output whose C++ node allocates the 8 gradients and runs nothing: the floor
    of kspec's step, whose node is a C++ one too), or None without the extension."""
    from kspec import _native

    return getattr(_native.ext, "noop_grad", None)


def _step(kind, fn, x, leaves, dout):
    """The timed call: the forward (no grad), or a training step through autograd (gradients reset to None
    first, as zero_grad does)."""
    if kind == "fwd":
        return lambda: fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"], True)

    def fwdbwd():
        for v in leaves.values():
            v.grad = None
        y = fn(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"], leaves["D"], leaves["z"],
               leaves["delta_bias"], True)
        y.backward(dout)
    return fwdbwd


def run(ctx):
    torch = ctx.torch
    kspec = ctx.kspec
    shapes = [(2, 1024, 1024)] if ctx.args.quick else [(8, 2048, 2048), (8, 5120, 2048), (8, 2048, 8192),
                                                      (1, 2048, 65536)]
    if ctx.args.scan_shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in ctx.args.scan_shapes.split(",")]
    peer = None
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as peer  # torch imported first
    except Exception as e:  # noqa: BLE001
        print(f"bench: selective_scan: mamba_ssm not importable ({brief(str(e))})", file=sys.stderr)
    n = 16
    rows = []
    for b, d, t in shapes:
        x = scan_inputs(torch, ctx.dev, b, d, t, n, ctx.args.seed)
        leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
        dout = torch.randn_like(x["u"])
        impls = [("kspec", kspec.ops.selective_scan_fn)] + ([("mamba_ssm", peer)] if peer else [])
        checked = {}  # impl -> its max_error, or the exception its forward raised
        for impl, fn in impls:
            if ctx.skipped(impl):
                continue
            try:
                checked[impl] = scan_check(torch, x, fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                                        x["delta_bias"], True).float().cpu())
            except Exception as e:  # noqa: BLE001
                checked[impl] = e
                if ctx.args.verbose:
                    traceback.print_exc()
        elems = b * d * t
        for kind, nbytes, ex2 in (("fwd", 2 * 4 * elems + 2 * 2 * b * n * t, elems * n),
                                  ("fwd+bwd", 2 * 11 * elems + 2 * 6 * b * n * t, 3 * elems * n)):
            if ctx.args.scan_kind not in ("both", kind):
                continue
            group, steps = [], []
            first = len(rows)
            noop_cpp = _cpp_floor() if kind == "fwd+bwd" else None
            floors = [(FLOOR, None)] + ([(FLOOR_CPP, noop_cpp)] if noop_cpp else []) if kind == "fwd+bwd" else []
            for impl, fn in impls + floors:
                row = {"family": "selective_scan", "shape": f"{b}x{d}x{t}", "impl": impl, "kind": kind,
                       "bytes": nbytes, "status": ""}
                rows.append(row)
                if impl in (FLOOR, FLOOR_CPP):  # no kernel, nothing to check: timed beside the others, same rounds
                    row["status"] = "floor"
                    group.append(row)
                    noop = (lambda *a: _NoopScan.apply(*a[:8])) if impl == FLOOR else (lambda *a: noop_cpp(a[:8]))
                    steps.append(_step(kind, noop, x, leaves, dout))
                    continue
                if ctx.skipped(impl):
                    row["status"] = "skipped"
                    continue
                if isinstance(checked[impl], Exception):
                    row["status"] = "error"
                    row["error"] = short_error(checked[impl])
                    continue
                row["max_error"] = checked[impl]
                row["valid"] = row["max_error"] <= 2e-2
                row["status"] = "ok" if row["valid"] else "INVALID"
                if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                    step = _step(kind, fn, x, leaves, dout)
                    try:
                        step()  # a backward that raises is this row's error, not the group's
                    except Exception as e:  # noqa: BLE001
                        row["status"] = "error"
                        row["error"] = short_error(e)
                        continue
                    group.append(row)
                    steps.append(step)
            try:
                timed = ctx.timer.time_rounds(steps) if steps else []
            except Exception as e:  # noqa: BLE001
                timed = []
                for row in group:
                    row["status"] = "error"
                    row["error"] = short_error(e)
            base_is_kspec = bool(group) and group[0]["impl"] == "kspec"
            for row, t_ in zip(group, timed):
                row.update(t_)
                row["bytes_floor_ms"] = nbytes / (ctx.args.peak_tbps * 1e12) * 1e3
                row["ex2_floor_ms"] = ex2 / SFU_EX2_PER_S * 1e3
                if base_is_kspec:
                    row["kspec_speedup_gpu"], row["kspec_speedup_ev"] = row["x_gpu"], row["x_ev"]
            for row in rows[first:]:
                print(f"bench: selective_scan {row['shape']} {row['impl']} {kind}: {row['status']}", file=sys.stderr,
                      flush=True)
        del x, leaves, dout
        torch.cuda.empty_cache()
    cols = [
        ("shape (B×D×L)", "shape"), ("impl", "impl"), ("kind", "kind"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
        ("bytes floor ms", lambda r: fmt(r.get("bytes_floor_ms"), ".3f")),
        ("ex2 floor ms", lambda r: fmt(r.get("ex2_floor_ms"), ".3f")),
        ("kspec × (gpu)", lambda r: fmt(r.get("kspec_speedup_gpu"), ".2f")),
        ("kspec × (ev)", lambda r: fmt(r.get("kspec_speedup_ev"), ".2f")),
        ("rel err (prefix)", lambda r: fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = ["targets (H100, peers.md): fwd <= 0.30 ms and fwd+bwd <= 1.5 ms at 8x2048x2048; >= 2x mamba_ssm"
             " (1.45/7.46, 2.75/12.3, 3.00/14.3 ms at the other shapes).",
             "validation: out[0, :4, :512] against the float64 reference before timing. Not benchmarked: a"
             " torch.compile of the reference (a Python loop over seqlen steps does not compile in useful time).",
             "timing: a shape's kspec and mamba_ssm steps interleaved, 10 rounds, each in turn (round r starting at"
             " impl r); gpu and ev ms the median of the rounds' medians, kspec × the median of the rounds' ratios"
             " (one slow stretch of the host moves both impls of a round, not one row).",
             f"{FLOOR} (fwd+bwd): torch's engine alone with the scan's inputs (out and 8 gradients allocated, no"
             " kernel), in the same rounds: the host floor of a Python autograd.Function such as mamba_ssm's.",
             f"{FLOOR_CPP} (fwd+bwd): the same through a C++ node (kspec._torch_ext.noop_grad), as kspec's is: what"
             " kspec's step costs above it is kspec's own."]
    return {"results": rows}, [Section("selective_scan: bf16, variable B/C, D, z, delta_bias, softplus, dstate 16",
                                       cols, rows, notes)]
