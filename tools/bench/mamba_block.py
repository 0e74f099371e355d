"""The Mamba block benchmark (issue 31's drop-in): kspec.nn.Mamba against mamba_ssm's
mamba_simple.Mamba (its fused CUDA path: causal_conv1d and mamba_inner_fn), forward and forward+backward,
on the same weights (kspec's state dict loaded strictly into mamba_ssm's), bf16 by default."""
from __future__ import annotations

import copy
import sys
import traceback

from .common import Section, brief, rel_error, short_error, speedup_vs_kspec
from .report import fmt

FAMILY = "mamba_block"
DESCRIPTION = "the Mamba block: kspec.nn.Mamba against mamba_ssm's Mamba, fwd and fwd+bwd"
NEEDS_BUILD = "mamba"  # the peer tools/gpu/check.sh builds from source (build_mamba.sh)
DTYPES = {"bfloat16", "float16", "float32"}
TOL = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-3}
CHECK_LEN = 256  # tokens of batch row 0 checked against the float64 block (causal: a prefix is exact)


def add_arguments(p):
    p.add_argument("--mamba-block-shapes", metavar="BxLxD,...", default="2x2048x1024,4x1024x2560",
                   help="mamba_block: batch x seqlen x d_model (default 2x2048x1024,4x1024x2560)")
    p.add_argument("--mamba-block-dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="mamba_block: parameter and activation dtype (default bfloat16)")


def block_flops(b: int, l: int, d: int, n: int = 16) -> float:
    """Forward matmul FLOPs of one block (d_state n, expand 2, dt_rank ceil(d/16)): in_proj d -> 2e, x_proj
    e -> r + 2n, dt_proj r -> e, out_proj e -> d, 2 FLOPs per multiply-add; the conv and the scan are
    O(e) and O(e·n) per token, under 2% at these sizes. Backward: twice the forward."""
    e, r = 2 * d, -(-d // 16)
    return 2.0 * b * l * (d * 2 * e + e * (r + 2 * n) + r * e + e * d)


def run(ctx):
    torch = ctx.torch
    kspec = ctx.kspec
    dtype_name = ctx.args.mamba_block_dtype
    dtype = getattr(torch, dtype_name)
    shapes = [(1, 512, 512)] if ctx.args.quick else [
        tuple(int(v) for v in s.split("x")) for s in ctx.args.mamba_block_shapes.split(",")]
    peer = None
    try:
        from mamba_ssm.modules.mamba_simple import Mamba as peer  # torch imported first
    except Exception as e:  # noqa: BLE001
        print(f"bench: mamba_block: mamba_ssm not importable ({brief(str(e))})", file=sys.stderr)
    rows = []
    for b, l, d in shapes:
        torch.manual_seed(ctx.args.seed)
        ours = kspec.nn.Mamba(d, device=ctx.dev, dtype=dtype)
        impls = [("kspec", ours)]
        if peer is not None:
            theirs = peer(d, device=ctx.dev, dtype=dtype)
            theirs.load_state_dict(ours.state_dict(), strict=True)
            impls.append(("mamba_ssm", theirs))
        x = torch.randn(b, l, d, device=ctx.dev, dtype=dtype)
        leaf = x.clone().requires_grad_()
        dy = torch.randn_like(x)
        # the float64 block on the CPU (kspec.nn.Mamba's torch path), on a prefix of batch row 0
        ref64 = copy.deepcopy(ours).double().cpu()
        with torch.no_grad():
            want = ref64(x[:1, :CHECK_LEN].double().cpu())
        del ref64
        flops = block_flops(b, l, d)
        for impl, m in impls:
            def fwd(m=m):
                with torch.no_grad():
                    return m(x)

            def fwdbwd(m=m):
                leaf.grad = None
                m.zero_grad(set_to_none=True)
                m(leaf).backward(dy)

            for kind, step, f in (("fwd", fwd, flops), ("fwd+bwd", fwdbwd, 3 * flops)):
                row = {"family": FAMILY, "shape": f"{b}x{l}x{d}", "impl": impl, "kind": kind, "dtype": dtype_name,
                       "flops": f, "status": ""}
                if ctx.skipped(impl):
                    row["status"] = "skipped"
                    rows.append(row)
                    continue
                try:
                    with torch.no_grad():
                        got = m(x[:1, :CHECK_LEN])
                    row["max_error"] = rel_error(got, want)
                    row["valid"] = row["max_error"] <= TOL[dtype_name]
                    row["status"] = "ok" if row["valid"] else "INVALID"
                    if row["valid"] or impl != "kspec" or ctx.args.time_invalid:
                        row.update(ctx.timer.time(step))
                        row["tflops"] = f / (row["gpu_ms"] * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001
                    row["status"] = "error"
                    row["error"] = short_error(e)
                    if ctx.args.verbose:
                        traceback.print_exc()
                rows.append(row)
                print(f"bench: mamba_block {row['shape']} {impl} {kind}: {row['status']}", file=sys.stderr,
                      flush=True)
        del impls, ours, x, leaf, dy
        torch.cuda.empty_cache()
    speedup_vs_kspec(rows)
    cols = [
        ("shape (B×L×D)", "shape"), ("impl", "impl"), ("kind", "kind"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
        ("matmul TFLOP/s", lambda r: fmt(r.get("tflops"), ".0f")),
        ("kspec × (gpu)", lambda r: fmt(r.get("kspec_speedup_gpu"), ".2f")),
        ("rel err (prefix)", lambda r: fmt(r.get("max_error"), ".1e")),
        ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
    ]
    notes = [f"validation: out[0, :{CHECK_LEN}] of each block against the float64 block (kspec.nn.Mamba's torch"
             " path) before timing; mamba_ssm loads kspec's state dict strictly, so both run the same weights.",
             "TFLOP/s counts the four projections only (block_flops); fwd+bwd counts 3x the forward."]
    return {"results": rows}, [Section(f"mamba_block: kspec.nn.Mamba vs mamba_ssm Mamba, {dtype_name}, d_state 16",
                                       cols, rows, notes)]
