"""E79 benchmark: kspec's cell (kspec.nn.E79Cell: the fused projection GEMM + the E79 kernels) against
the reference cell (kspec.reference.e79_torch.E79CoupledMatrixCell, the public model's loop) in torch
eager and torch.compile, forward and forward+backward, bf16, dim 1024. Not a test: timings only.

    python3 tools/bench/bench.py --family e79 --json e79.json    # B {1,16,128} x T {512,4096} x n {32,64,96,128}
    python3 tools/bench/bench.py --family e79 --e79-n 32 64 128  # issue 8's table alone (no n = 96)
    python3 tools/bench/bench.py --family e79 --quick --json /tmp/e79.json
    python3 tools/bench/bench.py --family e79 --e79-B 16 --e79-T 4096 --e79-n 64    # the target point
    python3 tools/bench/bench.py --family e79 --e79-B 1 16 --e79-no-compile --e79-clusters 2 4 8   # cluster rows

The options before the runner took this family over keep working without the e79- prefix (--B, --n,
--no-compile, ...: tools/gpu/check.sh's KSPEC_BENCH_E79_ARGS); --quick is the target point alone.
Method: random inputs; kspec's output checked against the reference loop (fp32 arithmetic on the
same bf16 inputs) on the first --check-T steps before anything is timed; the runner's timer (timing.py:
the L2 flushed before each call, gpu and ev times, the median of the timed calls) after two warm-up
calls: --reps (10 unless given) for kspec's rows, --ref-reps (3) for the two peers, whose calls are
long and whose spread is small next to the gaps measured. The ms and µs/step columns are ev times (a
synchronize, then events around the call: what a training step waits), the JSON rows carry gpu_ms too.
The peers are timed on min(T, --ref-T) steps and reported per step: a 4096-step eager or compiled
loop keeps every step's activations for autograd (B=128, n=128: ~80 MB a step) and torch.compile of
the whole unrolled loop does not finish in reasonable time, so torch.compile compiles one step
(fullgraph, dynamic=False: the best case for the peer, one compile per (B, n), shared by both T) and
Python loops over it; the compiled step is checked against the eager one on --check-T steps (a row
that disagrees is marked INVALID and still timed). Per-step cost is flat in T for all three (checked
by --ref-T).
Compiled kspec rows ("kspec compiled ..."): kspec.ops.e79, what E79Cell.forward calls, with the
cell's parameters under torch.compile(fullgraph=True, dynamic=True): the E79 cell and the projection
are torch.library custom ops, so the whole forward and backward is one graph; with dynamic shapes
(parameter shapes too) four compiles serve the whole grid (batch 1 or more, with or without a
gradient). Each point checks it against the eager call (out, final S, dx) before timing it; its time
over the eager rows' is the cost of going through torch.compile (about 1.0 expected: nothing to fuse).
Reported: ms per call, µs per time step, tokens/s (B*T per second), the speed-ups, and the bytes the
forward keeps per token for the backward (kspec: (S, M) every `chunk` steps, 8 n^2 / chunk).
Cluster rows (issue 8: one CTA per sequence leaves most of the 132 SMs idle at small B): for B in
--cluster-B, kspec again with each --clusters size forced (config "split=S,cluster=C": a cluster of C
CTAs per sequence, S lanes per row with n * S / C threads per CTA, the most up to 512), each validated
against the default config's output, final S and input gradient before it is timed, and its speed-up
over the cluster-1 row (one CTA per sequence, also timed) printed beside it. The default row is the
heuristic's config, which takes cluster 4 for n in {64, 96, 128} at B <= 16 on sm_90.
Time: each point prints its seconds, the run its total (also in the JSON). Where it goes: the
compiled peer's Inductor compiles (for each of the 12 (B, n) of the default grid: a no-grad step, a
step whose M needs no gradient yet, one whose M does, and their backwards), the NVRTC
compiles of kspec's kernels when the kernel cache is cold (fwd ~1 s, bwd ~2 s each on one CPU core:
one per n, config and kernel), the eager peer at B=128 (GPU-bound on (B, n, n) fp32 intermediates),
and the T=4096 kspec rows with their cluster rows. --ref-T, --ref-reps, --no-compile and --clusters
trade coverage for time.
Targets (issue 8): fwd+bwd at B=16, T=4096, n=64 >= 50x eager and >= 5x torch.compile.
"""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

FAMILY = "e79"
DESCRIPTION = "the E79 cell (projection GEMM + kernels) against the reference loop, eager and torch.compile"

TARGET = dict(B=16, T=4096, n=64, eager=50.0, compiled=5.0)
# (option, default, help); each is --e79-<option> and, as before the runner took this family over, --<option>.
OPTIONS = (
    ("B", [1, 16, 128], "batch sizes"),
    ("T", [512, 4096], "sequence lengths"),
    ("n", [32, 64, 96, 128], "state sizes"),
    ("cluster-B", [1, 16], "batch sizes that get cluster rows"),
    ("clusters", [2, 4, 8], "cluster sizes for the cluster rows (CTAs per sequence; sm_90+)"),
)


def add_arguments(p):
    for name, default, text in OPTIONS:
        p.add_argument(f"--e79-{name}", f"--{name}", type=int, nargs="+" if name in "BTn" else "*", default=default,
                       help=text)
    p.add_argument("--e79-dim", "--dim", type=int, default=1024)
    p.add_argument("--e79-dtype", "--dtype", default="bfloat16")
    p.add_argument("--e79-chunk", "--chunk", type=int, default=16)
    p.add_argument("--e79-reps", type=int, help="timed calls of kspec's rows (default: --reps when given, else 10)")
    p.add_argument("--e79-ref-reps", "--ref-reps", type=int, default=3,
                   help="timed calls of the eager/compiled peers (median)")
    p.add_argument("--e79-ref-T", "--ref-T", type=int, default=128,
                   help="steps the eager/compiled peers run (per-step cost)")
    p.add_argument("--e79-check-T", "--check-T", type=int, default=64)
    p.add_argument("--e79-no-compile", "--no-compile", action="store_true",
                   help="skip everything torch.compile: the compiled peer and the compiled kspec rows")


def options(args) -> SimpleNamespace:
    """This family's options without their prefix; --quick is the target point alone."""
    o = SimpleNamespace(**{k[len("e79_"):]: v for k, v in vars(args).items() if k.startswith("e79_")})
    if o.reps is None:
        o.reps = args.reps if args.reps_given else 10
    if args.quick:
        o.B, o.T, o.n = [TARGET["B"]], [TARGET["T"]], [TARGET["n"]]
    return o


def make_step(torch, F):
    """One step of the reference recurrence (the public model's forward body), for torch.compile."""

    def step(S, M, k, v, q, m, b_s, b_m):
        kh = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
        mh = m / (m.norm(dim=-1, keepdim=True) + 1e-6)
        s_row = torch.sigmoid(torch.einsum("bij,bj->bi", M, kh) + b_s)
        s_col = torch.sigmoid(torch.einsum("bji,bj->bi", M, kh) + b_s)
        s_delta = v - torch.einsum("bij,bj->bi", S, kh)
        S = s_row.unsqueeze(-1) * S * s_col.unsqueeze(1) + torch.einsum("bi,bj->bij", s_delta, kh)
        m_row = torch.sigmoid(torch.einsum("bij,bj->bi", S, mh) + b_m)
        m_col = torch.sigmoid(torch.einsum("bji,bj->bi", S, mh) + b_m)
        m_delta = s_delta - torch.einsum("bij,bj->bi", M, mh)
        M = m_row.unsqueeze(-1) * M * m_col.unsqueeze(1) + torch.einsum("bi,bj->bij", m_delta, mh)
        sq = torch.einsum("bij,bj->bi", S, q)
        return S, M, sq * F.silu(sq)

    return step


def reference_forward(torch, step, cell, x):
    """The reference cell's forward with `step` (eager or compiled) as the loop body; fp32 states."""
    n = cell.n_state
    T, B, _ = x.shape
    kvqm = (x @ cell.W_kvqm.T).float()
    S = torch.zeros(B, n, n, device=x.device)
    M = torch.zeros(B, n, n, device=x.device)
    b_s, b_m = cell.b_s_gate.float(), cell.b_m_gate.float()
    outs = []
    for t in range(T):
        k, v, q, m = kvqm[t].split(n, dim=-1)
        S, M, o = step(S, M, k, v, q, m, b_s, b_m)
        outs.append(o)
    return torch.stack(outs).to(x.dtype), S, M


def cluster_config(n: int, cluster: int):
    """The config a cluster row forces: the most lanes per row (split) with n * split / cluster threads
    per CTA in 32..512, a whole number of warps, split in cluster..min(32, n) (the op's rules); None
    when n admits none (n not a multiple of cluster)."""
    if n % cluster:
        return None
    for split in (32, 16, 8, 4, 2):
        threads = n * split // cluster
        if cluster <= split <= n and threads <= 512 and threads % 32 == 0:
            return f"split={split},cluster={cluster}"
    return None


def bench_point(torch, F, kspec, args, B, T, n, run, run_ref, compiled_step, eager_step, compiled_e79):
    from kspec.reference.e79_torch import E79CoupledMatrixCell

    dev, dt, dim = "cuda", getattr(torch, args.dtype), args.dim
    torch.manual_seed(B * 7 + T + n)
    ref_cell = E79CoupledMatrixCell(dim, n_state=n).to(dev, dt)
    cell = kspec.nn.E79Cell(dim, n, bias="fixed", chunk=args.chunk).to(dev, dt)
    cell.load_state_dict(ref_cell.state_dict(), strict=True)
    x = torch.randn(T, B, dim, device=dev, dtype=dt)

    # Validate before timing: the first check_T steps against the fp32 reference loop.
    tc = min(T, args.check_T)
    with torch.no_grad():
        out_k, S_k, _ = cell(x[:tc])
        out_r, S_r, _ = reference_forward(torch, eager_step, ref_cell, x[:tc])
    err = ((out_k.float() - out_r.float()).norm() / out_r.float().norm()).item()
    err_S = ((S_k - S_r).norm() / S_r.norm()).item()
    if not (err <= 2e-2 and err_S <= 2e-2):
        raise RuntimeError(f"kspec E79 disagrees with the reference: out {err:.3e}, S {err_S:.3e} (B={B} T={T} n={n})")

    rows = []

    def record(variant, t, steps, config="default", valid=True):
        ms = t["ev_ms"]
        rows.append(dict(B=B, T=T, n=n, variant=variant, config=config, steps=steps, ms=ms,
                         us_per_step=1e3 * ms / steps, tokens_per_s=B * steps / (ms * 1e-3), reps=t["reps"],
                         gpu_ms=t["gpu_ms"], host_us=t["host_us"], valid=valid))

    xg = x.clone().requires_grad_()
    dout = torch.randn(T, B, n, device=dev, dtype=dt)

    def k_fwd():
        with torch.no_grad():
            cell(x)

    def k_fwd_train():
        cell(xg)

    def k_fwdbwd():
        out, _, _ = cell(xg)
        out.backward(dout)

    def time_kspec(config):
        record("kspec fwd (inference)", run(k_fwd), T, config)
        record("kspec fwd (training)", run(k_fwd_train), T, config)
        record("kspec fwd+bwd", run(k_fwdbwd), T, config)

    time_kspec("default")
    compiled_check = {}
    if compiled_e79 is not None:
        # kspec.ops.e79 as E79Cell.forward calls it, under torch.compile: checked against the eager cell
        # (out and final S over all T without a gradient, dx over check_T steps).
        params = (cell.W_kvqm, cell.b_s_gate, cell.b_m_gate)

        def kc(xx):
            return compiled_e79(xx, *params)

        def kc_fwd():
            with torch.no_grad():
                kc(x)

        def kc_fwd_train():
            kc(xg)

        def kc_fwdbwd():
            out, _, _ = kc(xg)
            out.backward(dout)

        def rel(a, b):
            return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

        try:
            with torch.no_grad():
                got, want = kc(x), cell(x)
            errs = dict(out=rel(got[0], want[0]), S=rel(got[1], want[1]))
            xc = [x[:tc].clone().requires_grad_() for _ in range(2)]
            for fn, xx in ((kc, xc[0]), (cell, xc[1])):
                out, _, _ = fn(xx)
                out.backward(dout[:tc])
            errs["dx"] = rel(xc[0].grad, xc[1].grad)
            compiled_check = errs
            if not all(e <= 1e-3 for e in errs.values()):
                raise RuntimeError(f"compiled disagrees with eager: {errs}")
            record("kspec compiled fwd (inference)", run(kc_fwd), T)
            record("kspec compiled fwd (training)", run(kc_fwd_train), T)
            record("kspec compiled fwd+bwd", run(kc_fwdbwd), T)
        except Exception as e:  # noqa: BLE001  (reported in its line and the JSON; the run goes on)
            compiled_check = dict(compiled_check, error=f"{type(e).__name__}: {e}"[:300])
    cluster_checks = {}
    if B in args.cluster_B:
        # Each cluster config against the default one on the first check_T steps (out, final S, dx).
        xc = x[:tc].clone().requires_grad_()

        def short(config):
            cell.config = config
            xc.grad = None
            out, S, _ = cell(xc)
            out.backward(dout[:tc])
            return out.float(), S, xc.grad.float()

        base = short(None)
        # cluster 1 first: the one-CTA-per-sequence kernel the cluster rows are compared with (the default,
        # the heuristic's, may itself be a cluster).
        for c in [1] + [c for c in args.clusters if c != 1] if args.clusters else []:
            config = cluster_config(n, c)
            if config is None:
                continue
            try:  # a failing config is reported in its row; the others still run
                got = short(config)
                errs = [((g - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(got, base)]
                cluster_checks[config] = dict(out=errs[0], S=errs[1], dx=errs[2])
                if not all(e <= 2e-2 for e in errs):
                    raise RuntimeError(f"disagrees with the default config: out {errs[0]:.3e}, S {errs[1]:.3e}, "
                                       f"dx {errs[2]:.3e}")
                time_kspec(config)
            except Exception as e:  # noqa: BLE001
                cluster_checks[config] = dict(cluster_checks.get(config, {}), error=f"{type(e).__name__}: {e}"[:300])
        cell.config = None

    tr = min(T, args.ref_T)
    xr = x[:tr].clone().requires_grad_()
    dr = dout[:tr]
    peer_err = None
    for name, step in (("eager", eager_step), ("torch.compile", compiled_step)):
        if step is None:
            continue
        valid = True
        if step is compiled_step:  # the compiled step against the eager loop (this compiles its no-grad graph)
            with torch.no_grad():
                out_c, _, _ = reference_forward(torch, step, ref_cell, x[:tc])
            peer_err = ((out_c.float() - out_r.float()).norm() / out_r.float().norm()).item()
            valid = peer_err <= 2e-2

        def r_fwd(step=step):
            with torch.no_grad():
                reference_forward(torch, step, ref_cell, xr)

        def r_fwdbwd(step=step):
            out, _, _ = reference_forward(torch, step, ref_cell, xr)
            out.backward(dr)

        record(f"{name} fwd", run_ref(r_fwd), tr, valid=valid)
        record(f"{name} fwd+bwd", run_ref(r_fwdbwd), tr, valid=valid)
    return rows, dict(out_err=err, S_err=err_S, checked_steps=tc, compiled_peer_err=peer_err,
                      compiled_kspec_vs_eager=compiled_check, cluster_vs_default=cluster_checks)


def run(ctx):
    """Every (n, B, T) point: a line each as it finishes, the target verdict at the end."""
    a = options(ctx.args)
    torch = ctx.torch
    import torch.nn.functional as F

    import kspec

    if torch.cuda.get_device_capability()[0] < 9 and a.clusters:
        print("bench e79: thread-block clusters need sm_90 or newer; no cluster rows", file=sys.stderr)
        a.clusters = []

    def timed(fn):
        return ctx.timer.time(fn, reps=a.reps, warmup=2)

    def timed_ref(fn):
        return ctx.timer.time(fn, reps=a.ref_reps, warmup=2)

    eager_step = make_step(torch, F)
    # One compiled step per (B, n) point: dynamo's default of 8 recompiles is below the table's 12 points.
    torch._dynamo.config.recompile_limit = 64
    compiled_step = None if a.no_compile else torch.compile(make_step(torch, F), fullgraph=True, dynamic=False)
    compiled_e79 = None
    if not a.no_compile:
        # Symbolic parameter shapes too (n), so one graph serves every n; the peer's step is static anyway.
        torch._dynamo.config.force_parameter_static_shapes = False
        chunk = a.chunk

        def e79_fixed(x, W_kvqm, b_s, b_m):
            return kspec.ops.e79(x, W_kvqm, b_s, b_m, bias="fixed", chunk=chunk)

        compiled_e79 = torch.compile(e79_fixed, fullgraph=True, dynamic=True)

    rows, checks = [], []
    t_start = time.perf_counter()
    for n in a.n:
        for B in a.B:
            for T in a.T:
                t_point = time.perf_counter()
                r, c = bench_point(torch, F, kspec, a, B, T, n, timed, timed_ref, compiled_step, eager_step,
                                   compiled_e79)
                seconds = time.perf_counter() - t_point
                rows.extend(r)
                checks.append(dict(B=B, T=T, n=n, seconds=seconds, **c))
                by = {x["variant"]: x for x in r if x["config"] == "default"}
                us = {v: x["us_per_step"] for v, x in by.items()}
                kf, ks = us["kspec fwd (inference)"], us["kspec fwd+bwd"]
                line = (f"B={B:4d} T={T:5d} n={n:4d}  kspec fwd {kf:8.2f} fwd(train) "
                        f"{us['kspec fwd (training)']:8.2f} fwd+bwd {ks:8.2f} µs/step  "
                        f"{by['kspec fwd+bwd']['tokens_per_s']:.3g} tok/s")
                for peer in ("eager", "torch.compile"):
                    if f"{peer} fwd+bwd" in by:
                        line += (f" | {peer}: fwd {us[f'{peer} fwd'] / kf:6.1f}x fwd+bwd {us[f'{peer} fwd+bwd'] / ks:6.1f}x"
                                 f"{'' if by[f'{peer} fwd+bwd']['valid'] else ' INVALID'}")
                if "kspec compiled fwd+bwd" in by:  # compiled kspec's time over eager kspec's
                    line += (f" | kspec compiled/eager: fwd {us['kspec compiled fwd (inference)'] / kf:5.2f} "
                             f"fwd+bwd {us['kspec compiled fwd+bwd'] / ks:5.2f}")
                elif "error" in c["compiled_kspec_vs_eager"]:
                    line += f" | kspec compiled FAILED: {c['compiled_kspec_vs_eager']['error']}"
                line += f" | saved {kspec.ops.e79_checkpoint_bytes_per_token(n, a.chunk):.0f} B/token [{seconds:.0f} s]"
                print(line, flush=True)
                one = cluster_config(n, 1)
                base = {x["variant"]: x for x in r if x["config"] == one} or by
                for config, chk in c["cluster_vs_default"].items():
                    if "error" in chk:
                        print(f"{'':27s}{config:<19s} FAILED: {chk['error']}", flush=True)
                        continue
                    cb = {x["variant"]: x for x in r if x["config"] == config}
                    us = {v: cb[f"kspec {v}"]["us_per_step"] for v in ("fwd (inference)", "fwd (training)", "fwd+bwd")}
                    gain = {v: base[f"kspec {v}"]["us_per_step"] / us[v] for v in us}
                    print(f"{'':27s}{config:<19s} fwd {us['fwd (inference)']:8.2f} fwd(train) "
                          f"{us['fwd (training)']:8.2f} fwd+bwd {us['fwd+bwd']:8.2f} µs/step  "
                          f"{cb['kspec fwd+bwd']['tokens_per_s']:.3g} tok/s | vs 1 CTA/sequence: fwd "
                          f"{gain['fwd (inference)']:5.2f}x fwd+bwd {gain['fwd+bwd']:5.2f}x "
                          f"{'WINS' if gain['fwd+bwd'] > 1.0 else 'loses'}", flush=True)

    verdict = {}
    for x in rows:
        if (x["B"], x["T"], x["n"]) == (TARGET["B"], TARGET["T"], TARGET["n"]) and x["config"] == "default":
            verdict[x["variant"]] = x["us_per_step"]
    if "kspec fwd+bwd" in verdict:
        for peer, need in (("eager", TARGET["eager"]), ("torch.compile", TARGET["compiled"])):
            if f"{peer} fwd+bwd" in verdict:
                s = verdict[f"{peer} fwd+bwd"] / verdict["kspec fwd+bwd"]
                print(f"target fwd+bwd B=16 T=4096 n=64 vs {peer}: {s:.1f}x (need >= {need}x): "
                      f"{'PASS' if s >= need else 'FAIL'}")
    total = time.perf_counter() - t_start
    print(f"bench e79: {len(checks)} points, {len(rows)} rows in {total:.0f} s")
    return {"rows": rows, "checks": checks, "options": vars(a), "verdict_us_per_step": verdict}
