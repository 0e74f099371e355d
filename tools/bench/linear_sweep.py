"""The linear_sweep benchmark: kspec.ops.linear's untuned default against torch's F.linear (+ a separate
activation)."""
from __future__ import annotations

import math
import os

from .common import Section, rel_error, short_error, to_f64
from .report import fmt

FAMILY = "linear_sweep"
DESCRIPTION = "kspec.ops.linear's untuned default against F.linear + act over odd shapes (a sweep)"
IN_ALL = False  # a sweep, run on request (KSPEC_TUNE=off: the untuned default)


LINEAR_RATIO_MIN = 1 / 1.1  # issue 33: the default within 1.1x of torch for every act (torch ms / kspec ms)


def linear_sweep_shapes(quick: bool) -> list:
    """(m, n, k) = (tokens, out features, in features): small K (7, 33, 64), small M (1, 32), odd N (4095,
    4097), the issue's shapes, and LLM layers (4096-wide, Llama-2-7B's MLP 11008)."""
    if quick:
        return [(33, 4097, 7), (4097, 4095, 33), (32, 4096, 4096), (2048, 2048, 2048)]
    return [(33, 4097, 7), (4097, 4095, 7), (4097, 4095, 33), (4097, 4095, 64), (16384, 4096, 33),
            (16384, 4096, 64), (1, 4096, 4096), (32, 4096, 4096), (1, 11008, 4096), (32, 4097, 4096),
            (4096, 4097, 4096), (4096, 4095, 1024), (4096, 4096, 4096), (16384, 4096, 4096),
            (16384, 11008, 4096)]


def linear_path(kspec, x, w, b, act) -> str:
    """Which path kspec.ops.linear's gemm takes: 'fused' (cuBLASLt's epilogue), 'unfused=1|2' (the plain
    GEMM, then kspec's bias/act kernel), '+C bias' / '+K bias' (relu in 16-bit: the bias summed in fp32, as
    C or as one more column of x and W), and
    where the config came from (heuristic or tuned)."""
    e = kspec.explain("gemm", x, w, b, act=act)
    path = e.config if e.config.startswith("unfused") else "fused"
    if any("gemm_fill_bias" in k["name"] for k in e.kernels):
        path += " +C bias"
    if any("gemm_augment" in k["name"] for k in e.kernels):
        path += " +K bias"
    return f"{path} ({e.config_source})"


def run(ctx):
    """kspec.ops.linear's default (run with KSPEC_TUNE=off for the untuned heuristic; the path column says
    which config ran and where it came from) against F.linear + act, bf16, forward; for relu and gelu also
    each path forced, so the default's thresholds (api/ops/gemm/op.cpp, default_unfused) can be
    read off the table."""
    torch = ctx.torch
    kspec = ctx.kspec
    F = torch.nn.functional
    tact = {"none": lambda t: t, "relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh")}
    rows = []
    for i, (m, n, k) in enumerate(linear_sweep_shapes(ctx.args.quick)):
        g = torch.Generator(device=ctx.dev).manual_seed(ctx.args.seed + i)
        x = torch.randn(m, k, device=ctx.dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device=ctx.dev, generator=g) / math.sqrt(k)).to(torch.bfloat16)
        b = torch.randn(n, device=ctx.dev, generator=g).to(torch.bfloat16)
        for act in ("none", "relu", "gelu"):
            rows_checked = min(m, ctx.args.check_rows)
            want = to_f64(tact[act](F.linear(x[:rows_checked].float(), w.float(), b.float())))
            variants = [("kspec linear", lambda: kspec.ops.linear(x, w, b, act)),
                        ("torch F.linear" + (f" → {act}" if act != "none" else ""),
                         lambda: tact[act](F.linear(x, w, b)))]
            for cfg in {"none": (), "relu": ("", "unfused=1"), "gelu": ("", "unfused=1", "unfused=2")}[act]:
                variants.append((f"kspec gemm {cfg or 'fused'}",
                                 lambda cfg=cfg: kspec.call("gemm", x, w, b, act=act, config=cfg)[0]))
            base = {"shape": f"{m}x{n}x{k}", "m": m, "n": n, "k": k, "act": act, "dtype": "bf16"}
            group = []
            for name, fn in variants:
                if ctx.skipped(name):
                    continue
                row = {**base, "variant": name}
                try:
                    with torch.no_grad():
                        err = rel_error(to_f64(fn()[:rows_checked]), want)
                        row["rel_err"] = err
                        if err > 2e-2:
                            raise RuntimeError(f"wrong result: rel err {err:.2e} against fp32 (first rows)")
                        row.update(ctx.timer.time(fn))
                    row["status"] = "ok"
                except Exception as e:  # noqa: BLE001
                    row["status"], row["error"] = "failed", short_error(e, 300)
                if name == "kspec linear":
                    row["path"] = linear_path(kspec, x, w, b, act)
                group.append(row)
            ks = next((r for r in group if r["variant"] == "kspec linear" and "gpu_ms" in r), None)
            pt = next((r for r in group if r["variant"].startswith("torch") and "gpu_ms" in r), None)
            for r in group:
                if pt and "gpu_ms" in r:
                    r["torch_over"] = pt["gpu_ms"] / r["gpu_ms"]
            if ks and pt:
                ks["target"] = "ok" if ks["torch_over"] >= LINEAR_RATIO_MIN else "MISSED"
            rows += group
        del x, w, b
        torch.cuda.empty_cache()
    cols = [("shape m×n×k", "shape"), ("act", "act"), ("variant", "variant"), ("path", "path"),
            ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".4f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".4f")),
            ("torch / this (gpu)", lambda r: fmt(r.get("torch_over"), ".2f")), ("target", "target"),
            ("rel err", lambda r: fmt(r.get("rel_err"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    missed = [f"{r['shape']} {r['act']}" for r in rows if r.get("target") == "MISSED"]
    notes = [f"target: torch ms / kspec linear ms ≥ {LINEAR_RATIO_MIN:.3f} (within 1.1x) for every act; "
             + (f"MISSED at {', '.join(missed)}" if missed else "met everywhere"),
             "path: what the default ran (explain's config; heuristic unless KSPEC_TUNE is on with a tuned "
             "entry). 'kspec gemm fused / unfused=N': that path forced, for setting api/ops/gemm/op.cpp's "
             "default_unfused rule (run with KSPEC_TUNE=off)."]
    return {"results": rows, "tune_mode": os.environ.get("KSPEC_TUNE", "on")}, \
        [Section("linear_sweep: kspec.ops.linear default vs torch F.linear (+ act), bf16 forward", cols, rows, notes)]
