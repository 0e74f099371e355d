"""The difflogic benchmark (issue 30): a differentiable logic gate layer, forward and forward+backward, kspec's
LogicLayer against difflogic 0.1.0's (its CUDA extension, when importable: built on the GPU machine by
tools/gpu/build_difflogic.sh) and the same layer in torch eager, on the same weights and wiring, in one
process."""
from __future__ import annotations

import contextlib
import sys
import time

from .common import Section, brief, record_failure
from .report import fmt, peer_report

FAMILY = "difflogic"
DESCRIPTION = "logic gate layers: kspec.nn.LogicLayer against difflogic 0.1.0 and torch eager"
NEEDS_BUILD = "difflogic"  # the peer tools/gpu/check.sh builds from source (build_difflogic.sh)

CHECK_SAMPLES = 16  # samples compared with the float64 reference (dy zero on the others)
TOL = {"float32": (1e-4, 1e-4), "bfloat16": (1e-2, 2e-2)}  # issue 30: fp32 1e-4; bf16 bounds ours
FWD_PCT, FWDBWD_VS_PEER = 60.0, 4.0  # issue 30: >= 60% of 3 TB/s forward; fwd+bwd >= 4x difflogic (fp32)
# Calls of SLOW_MS or more (the CA's BPTT step at B = 64 and 256: 0.17-1.1 s a call; torch eager at 16k x 16k;
# the packed network at B = 2^18) are timed with fewer reps: about ROW_MS of calls a row, at least one, after one
# warm-up call (the validation call before it warmed it as well). The same quantity (median gpu / ev time of a
# call, L2 flushed), fewer samples: at the run's 50 reps a 0.66 s call took over a minute a row, and the CA and
# 16k tables never finished.
SLOW_MS, ROW_MS = 10.0, 2000.0


def add_arguments(p):
    p.add_argument("--difflogic-shapes", metavar="BxN_INxN_OUT,...", default="1024x64000x64000",
                   help="difflogic: layer shapes (default 1024x64000x64000; issue 30 also 16384x16000x16000)")
    p.add_argument("--difflogic-dtypes", metavar="DT,...", default="float32,bfloat16",
                   help="difflogic: activation dtypes (difflogic 0.1.0 runs float32 only)")
    p.add_argument("--difflogic-packed-batches", metavar="B,...", default="16384,262144",
                   help="difflogic: packed inference batches (784 -> 6 x 64k -> GroupSum(10); issue 30)")
    p.add_argument("--difflogic-ca-batches", metavar="B,...", default="1,2,64,256",
                   help="difflogic: CA batches (16x16x8 checkerboard, T = 20, one BPTT training step; issue 30)")
    p.add_argument("--difflogic-parts", metavar="PART,...", default="layer,packed,ca",
                   help="difflogic: which tables: layer (a), packed (b), ca (c) (default all three)")
    p.add_argument("--difflogic-net-configs", metavar="CFG;...",
                   default="algo=layers,chunk=128,inflight=2;algo=chunked,chunk=128,inflight=2;"
                           "algo=early,chunk=128,inflight=2;algo=early_late,chunk=128,inflight=2;"
                           "algo=early,chunk=64,inflight=4;algo=early,chunk=256,inflight=1;"
                           "algo=fold,chunk=128,inflight=2;algo=fold,chunk=64,inflight=4;algo=fold2,chunk=128,inflight=2",
                   help="difflogic: difflogic.packed.net configs timed in the packed table (';'-separated; '' none)")
    p.add_argument("--difflogic-lanes", metavar="L,...", default="0,4,8,16,32",
                   help="difflogic: feature-major configs timed beside the default one, the same lanes in the forward"
                        " and the backward, the backward's ahead=0 (0: the flat kernels; else the batch-tiled ones;"
                        " '' none)")
    p.add_argument("--difflogic-ahead-lanes", metavar="L,...", default="",
                   help="difflogic: the same with the backward's ahead=1 (readers' loads a step ahead, the default's;"
                        " batch-tiled lanes only; '' none)")


def min_bytes(B, n_in, n_out, kind, s):
    """Forward: x read once (gathered), y written, the logits (64 B a gate) read. The backward adds dy read,
    x read again, dx written, the logits read and dlogits written."""
    fwd = (B * n_in + B * n_out) * s + 64 * n_out
    return fwd if kind == "fwd" else fwd + (2 * B * n_in + B * n_out) * s + 128 * n_out


def torch_layer(torch, truth):
    """The layer in torch eager: T = softmax(logits) @ truth (4 numbers a gate), y = sum_uv T_uv P(a=u) P(b=v)."""
    def layer(x, logits, a, b):
        t = (torch.softmax(logits, dim=-1) @ truth).to(x.dtype)
        xa, xb = x[:, a], x[:, b]
        return t[:, 0] * (1 - xa) * (1 - xb) + t[:, 1] * (1 - xa) * xb + t[:, 2] * xa * (1 - xb) + t[:, 3] * xa * xb

    return layer


def timed(ctx, fn, prep, first_ms):
    """ctx.timer.time(fn, prep), with the reps cut for a slow call: first_ms, the wall time of the call that
    validated it (timed once more where slow: a first call may include compiling). A timing pass costs about
    4 reps + 1 calls (a host-bound call's GPU pass is repeated up to 3 times when the spin cannot cover its
    enqueueing, then the ev pass)."""
    if first_ms >= SLOW_MS:
        prep()
        t0 = time.perf_counter()
        fn()
        ctx.torch.cuda.synchronize()
        first_ms = min(first_ms, (time.perf_counter() - t0) * 1e3)
    if first_ms < SLOW_MS:
        return ctx.timer.time(fn, prep)
    reps = max(1, min(ctx.timer.reps, int((ROW_MS / first_ms - 1) / 4)))
    return ctx.timer.time(fn, prep, reps=reps, warmup=1)


def _peer():
    try:
        import difflogic  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return None, f"difflogic not importable ({brief(str(e))})"
    return difflogic, None


def _reference(x, logits, a, b, dy):
    from kspec.reference import difflogic as ref

    c = CHECK_SAMPLES
    xs, dys = x[:c].double().cpu().numpy(), dy[:c].double().cpu().numpy()
    lg, wa, wb = logits.double().cpu().numpy(), a.cpu().numpy(), b.cpu().numpy()
    dx, dl = ref.layer_bwd(dys, xs, lg, wa, wb)
    return {"y": ref.layer_fwd(xs, lg, wa, wb), "dx": dx, "dlogits": dl}


def _err(got, want):
    import numpy as np

    got = got.detach().double().cpu().numpy()
    if got.shape != want.shape:
        got = got[:CHECK_SAMPLES]
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


# The row-major forward's flat kernel (the gather the staged kernel replaced).
FLAT_FWD_CONFIG = "threads=256,lanes=0,stage=0"


def layer_configs(lanes, ahead=0):
    """(forward, backward) configs of the feature-major layer at threads=256,lanes=L: the forward's stage=0
    (feature-major has no staged kernel), the backward's ahead=A (1 only with the batch-tiled lanes > 0)."""
    config = f"threads=256,lanes={lanes}"
    return config + ",stage=0", config + f",ahead={ahead if lanes else 0},pool=0"


def configured_layer(torch, layer, lanes, ahead=0):
    """The layer on feature-major x with the configs of layer_configs(L, A) (kspec.nn.LogicLayer takes the
    heuristic's: lanes 16 forward, 32 backward, ahead 1): the kernels old and new side by side in one process."""
    from kspec._core import call

    fwd_config, bwd_config = layer_configs(lanes, ahead)
    a, b, csr = layer.wiring()

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, logits):
            y = torch.empty(logits.shape[0], x.shape[0], dtype=x.dtype, device=x.device).t()
            call("difflogic.layer.fwd", x, logits, a, b, layout="feature_major", config=fwd_config, out=(y, None))
            ctx.save_for_backward(x, logits)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, logits = ctx.saved_tensors
            dy = dy if dy.stride(0) == 1 else dy.t().contiguous().t()
            dx = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype, device=x.device).t()
            dl = torch.empty_like(logits)
            call("difflogic.layer.bwd", x, logits, a, b, dy, csr, layout="feature_major", config=bwd_config,
                 out=(dx, dl))
            return dx, dl

    return lambda x: Fn.apply(x, layer.weights)


def staged_layer(torch, layer, fwd_config, bwd_config=None):
    """The layer on row-major x as row_major="staged" runs it, with explicit configs: the forward op on the
    row-major x with save_xt (fwd_config: stage=1 the one-block staged kernel writing xt from shared memory,
    stage=2/4 the cluster kernel, xt then by the transpose kernel; under no_grad without xt), y row-major; the
    backward transposes dy and runs the feature-major backward on xt (bwd_config; None: its default), dx
    row-major."""
    from kspec._core import call
    from kspec._difflogic import transpose

    a, b, csr = layer.wiring()

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, logits):
            y, xt = call("difflogic.layer.fwd", x, logits, a, b, config=fwd_config, save_xt=True)
            ctx.save_for_backward(xt, logits)
            return y

        @staticmethod
        def backward(ctx, dy):
            xt, logits = ctx.saved_tensors
            xf = xt.t()
            dx, dl = call("difflogic.layer.bwd", xf, logits, a, b, transpose(dy.contiguous()).t(), csr,
                          layout="feature_major", dx_layout="row_major", config=bwd_config,
                          out=(xf.new_empty(xf.shape), torch.empty_like(logits)))
            return dx, dl

    def run(x):
        if torch.is_grad_enabled():
            return Fn.apply(x, layer.weights)
        return call("difflogic.layer.fwd", x, layer.weights, a, b, config=fwd_config)[0]

    return run


def transposed_layer(torch, layer, bwd_config):
    """The default training path on row-major x (x transposed by kspec's transpose, the feature-major forward at
    its default config, y feature-major; dy transposed, dx row-major) with the backward's config bwd_config: the
    pooled backward beside the default in one process."""
    from kspec._core import call
    from kspec._difflogic import transpose

    a, b, csr = layer.wiring()

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, logits):
            xf = transpose(x).t()
            y = torch.empty(logits.shape[0], x.shape[0], dtype=x.dtype, device=x.device).t()
            call("difflogic.layer.fwd", xf, logits, a, b, layout="feature_major", out=(y, None))
            ctx.save_for_backward(xf, logits)
            return y

        @staticmethod
        def backward(ctx, dy):
            xf, logits = ctx.saved_tensors
            dy = dy if dy.stride(0) == 1 else transpose(dy.contiguous()).t()
            dx, dl = call("difflogic.layer.bwd", xf, logits, a, b, dy, csr, layout="feature_major",
                          dx_layout="row_major", config=bwd_config,
                          out=(xf.new_empty(xf.shape), torch.empty_like(logits)))
            return dx, dl

    return lambda x: Fn.apply(x, layer.weights)


# The pooled backward (difflogic.layer.bwd config pool: a block's inputs handed out on demand) at the default
# lanes 32: readers a step ahead (fp32: 72 registers, 3 blocks of 256 an SM) or not ("a0": 61, 4 blocks), 256 or
# 128 threads.
POOL_CONFIGS = {"pool=32": "threads=256,lanes=32,ahead=1,pool=32",
                "pool=32 a0": "threads=256,lanes=32,ahead=0,pool=32",
                "pool=64 a0": "threads=256,lanes=32,ahead=0,pool=64",
                "pool=32 t128": "threads=128,lanes=32,ahead=1,pool=32"}
STAGED_FWD = "threads=256,lanes=0,stage={}"
# The hybrid forward (h-dl11, stage 8: a row's first columns in shared memory, the rest from L1/L2, one row a
# pass, 20-byte gate records): its fwd row is the hybrid kernel alone (no_grad), fwd+bwd adds the transpose of x
# for xt and the feature-major backward. Named without "staged" so that --skip staged leaves it.
HYBRID_FWD = STAGED_FWD.format(8)


def flat_row_major_layer(torch, layer):
    """The layer on row-major x through the flat row-major kernels (the forward's config stage=0: the gather
    from global memory that the staged kernel replaced; the row-major backward), y row-major."""
    from kspec._core import call

    a, b, csr = layer.wiring()

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, logits):
            ctx.save_for_backward(x, logits)
            return call("difflogic.layer.fwd", x, logits, a, b, config=FLAT_FWD_CONFIG)[0]

        @staticmethod
        def backward(ctx, dy):
            x, logits = ctx.saved_tensors
            dx, dl = call("difflogic.layer.bwd", x, logits, a, b, dy.contiguous(), csr)
            return dx, dl

    return lambda x: Fn.apply(x, layer.weights)


def run(ctx):
    parts = ctx.args.difflogic_parts.split(",")
    results, sections = {}, []
    if "layer" in parts:
        results, sections = run_layer(ctx)
    if "packed" in parts:
        results["packed"], section = run_packed(ctx)
        sections.append(section)
    if "ca" in parts:
        results["ca"], section = run_ca(ctx)
        sections.append(section)
    return results, sections


def run_layer(ctx):
    torch, kspec = ctx.torch, ctx.kspec
    shapes = [tuple(int(v) for v in s.split("x")) for s in ctx.args.difflogic_shapes.split(",")]
    dtypes = ctx.args.difflogic_dtypes.split(",")
    if ctx.args.quick:
        shapes = [(256, 8000, 8000)]
    peer_mod, why = _peer()
    if why:
        print(f"bench: difflogic: {why}", file=sys.stderr)
    from kspec.reference.difflogic import TRUTH

    truth = torch.tensor(TRUTH, dtype=torch.float32, device=ctx.dev)
    eager = torch_layer(torch, truth)
    lanes = [int(n) for n in ctx.args.difflogic_lanes.split(",") if n.strip()]
    ahead_lanes = [int(n) for n in ctx.args.difflogic_ahead_lanes.split(",") if n.strip()]
    rows, notes = [], []
    for B, n_in, n_out in shapes:
        # One seed, one draw: difflogic's layer and kspec's (same weights and wiring by construction; checked)
        peer = None
        if peer_mod is not None:
            torch.manual_seed(ctx.args.seed)
            peer = peer_mod.LogicLayer(n_in, n_out, device="cuda", implementation="cuda")
        torch.manual_seed(ctx.args.seed)
        layer = kspec.nn.LogicLayer(n_in, n_out, device=ctx.dev)
        if peer is not None:
            same = torch.equal(peer.weights, layer.weights) and torch.equal(torch.stack(list(peer.indices)),
                                                                            layer.indices)
            notes.append(f"{B}x{n_in}x{n_out}: difflogic's and kspec's layers from one seed: "
                         f"{'the same weights and wiring' if same else 'DIFFERENT weights or wiring'}")
        a, b = layer.indices[0], layer.indices[1]
        g = torch.Generator(device=ctx.dev).manual_seed(ctx.args.seed + 1)
        x32 = torch.rand(B, n_in, device=ctx.dev, generator=g)
        dy32 = torch.randn(B, n_out, device=ctx.dev, generator=g)
        for dt in dtypes:
            dtype = getattr(torch, dt)
            x, dy = x32.to(dtype), dy32.to(dtype)
            dy_check = torch.zeros_like(dy)
            dy_check[:CHECK_SAMPLES] = dy[:CHECK_SAMPLES]
            ref = _reference(x, layer.weights.detach(), a, b, dy_check)
            # kspec both ways: x (and dy) as given, row-major; and feature-major (the user hands over x.t() of
            # a contiguous (n_in, B), difflogic's own layout: y, dx come back feature-major, no copies timed).
            # "kspec" on a row-major x: transposed once to feature-major (kspec's transpose kernel; y comes back
            # feature-major, a row-major dy is transposed, dx written row-major by the backward: 2 transposes a
            # step, timed);
            # "row-major direct": the row-major kernels (the old path); "torch transpose": the same feature-major
            # kernels behind torch's x.t().contiguous() (autograd copies dx back into x's strides).
            wa, wb, csr = layer.wiring()
            def with_row_major(row_major, w=layer.weights):
                return lambda x: kspec.ops.logic_layer(x, w, wa, wb, consumers=csr, row_major=row_major)

            impls = [("kspec", "kspec", lambda x, m=layer: m(x), layer.weights, False),
                     ("kspec transpose", "kspec", with_row_major("transpose"), layer.weights, False),
                     ("kspec staged", "kspec", with_row_major("staged"), layer.weights, False),
                     ("kspec row-major direct", "kspec", with_row_major("direct"), layer.weights, False),
                     ("kspec row-major flat", "kspec", flat_row_major_layer(torch, layer), layer.weights, False),
                     ("kspec torch transpose", "kspec", lambda x, m=layer: m(_feature_major(x)), layer.weights, False),
                     ("kspec feature-major", "kspec", lambda x, m=layer: m(x), layer.weights, True)]
            # New paths (h-dlr10): the staged forward writing xt with the pooled backward; the cluster-staged
            # forward (stage 2, 4; its fwd row is the cluster kernel alone, fwd+bwd adds the transpose of x for
            # xt); the default transpose path with the pooled backward. bf16's row-major dx at lanes 32 stages
            # 64 x 257 floats at pool 64, over 48 KB: that config is fp32's only.
            pools = {k: v for k, v in POOL_CONFIGS.items() if dt == "float32" or "pool=64" not in k}
            impls += [(f"kspec staged {k}", "kspec", staged_layer(torch, layer, STAGED_FWD.format(1), v),
                       layer.weights, False) for k, v in pools.items()]
            impls += [(f"kspec staged cluster={c}", "kspec", staged_layer(torch, layer, STAGED_FWD.format(c)),
                       layer.weights, False) for c in (2, 4)]
            impls.append(("kspec hybrid", "kspec", staged_layer(torch, layer, HYBRID_FWD), layer.weights, False))
            impls += [(f"kspec transpose {k}", "kspec", transposed_layer(torch, layer, v), layer.weights, False)
                      for k, v in pools.items()]
            impls += [(f"kspec feature-major lanes={n}", "kspec", configured_layer(torch, layer, n), layer.weights,
                       True) for n in lanes]
            impls += [(f"kspec feature-major lanes={n} ahead", "kspec", configured_layer(torch, layer, n, ahead=1),
                       layer.weights, True) for n in ahead_lanes]
            impls += [
                     ("torch eager", "peer", lambda x, w=layer.weights: eager(x, w, a, b), layer.weights, False)]
            if peer is not None and dtype == torch.float32:
                impls.append(("difflogic 0.1.0", "peer", peer, peer.weights, False))
            for name, impl, fn, weights, fm in impls:
                for kind in ("fwd", "fwd+bwd"):
                    row = {"family": "difflogic", "shape": f"{B}x{n_in}→{n_out}", "dtype": dt, "variant": name,
                           "impl": impl, "kind": kind, "bytes": min_bytes(B, n_in, n_out, kind, x.element_size()),
                           "status": ""}
                    if ctx.skipped(name):
                        row["status"] = "skipped"
                        rows.append(row)
                        continue
                    try:
                        row.update(_run_one(ctx, torch, fn, weights, x, dy, dy_check, kind, ref, impl, dt, fm))
                    except Exception as e:  # noqa: BLE001
                        record_failure(row, e, ctx.args.verbose, torch)
                    rows.append(row)
                    print(f"bench: difflogic {row['shape']} {dt} {name} {kind}: {row['status']}", file=sys.stderr,
                          flush=True)
        del layer, peer
        torch.cuda.empty_cache()
    for r in rows:
        base = next((k for k in rows if k["variant"] == "kspec" and k["shape"] == r["shape"] and k["dtype"] == r["dtype"]
                     and k["kind"] == r["kind"] and "gpu_ms" in k), None)
        if "gpu_ms" in r:
            r["gbps"] = r["bytes"] / (r["gpu_ms"] * 1e6)
            r["pct_of_peak"] = 100.0 * r["bytes"] / (r["gpu_ms"] * 1e-3) / (ctx.args.peak_tbps * 1e12)
            if base:
                r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]
                r["kspec_speedup_ev"] = r["ev_ms"] / base["ev_ms"]
    return _report(ctx, rows, notes, why)


# ---- (b) packed inference: 784 -> 6 x 64k -> GroupSum(10) ----

PACKED_IN, PACKED_WIDTH, PACKED_LAYERS, PACKED_K = 784, 64000, 6, 10
FLOAT_MAX_B = 1 << 14  # the float paths keep (B, 64k) activations: 4 GB fp32 at 2^14, 64 GB at 2^18
CHECK_PACKED = 1024  # samples of a large batch checked against the float hard path


# difflogic.packed.fwd's rows kernel (a thread per 128 bits of a gate's row, the same cost per bit at w = 32 and
# 64): 128 threads cover 512 words of a row, all of B = 2^14's at w = 32.
ROWS_CONFIG = "threads=128,vec=1"


def packed_bytes(B, w):
    """A floor: every layer's input words read once (a gate reads two rows, from L2 at best), its output
    words written, 64 B of logits a gate; then the counts (int32)."""
    words = -(-B // w) * (w // 8)  # bytes of one packed row
    rows = PACKED_IN + PACKED_WIDTH * PACKED_LAYERS
    return rows * words + PACKED_WIDTH * (PACKED_LAYERS - 1) * words + 64 * PACKED_WIDTH * PACKED_LAYERS + 4 * B * PACKED_K


def run_packed(ctx):
    torch, kspec = ctx.torch, ctx.kspec
    from kspec._core import call

    batches = [1024] if ctx.args.quick else [int(b) for b in ctx.args.difflogic_packed_batches.split(",")]
    width = 4000 if ctx.args.quick else PACKED_WIDTH
    peer_mod, why = _peer()
    torch.manual_seed(ctx.args.seed)
    layers, n_in = [], PACKED_IN
    for _ in range(PACKED_LAYERS):
        layers.append(kspec.nn.LogicLayer(n_in, width, device=ctx.dev).eval())
        n_in = width
    wiring = [(m.weights.detach(), m.indices[0].int().contiguous(), m.indices[1].int().contiguous()) for m in layers]
    peer = None
    if peer_mod is not None:
        try:
            torch.manual_seed(ctx.args.seed)
            peer = torch.nn.Sequential(*[peer_mod.LogicLayer(PACKED_IN if i == 0 else width, width, device="cuda",
                                                             implementation="cuda") for i in range(PACKED_LAYERS)],
                                       peer_mod.GroupSum(PACKED_K, 1.0)).eval()
        except Exception as e:  # noqa: BLE001
            why = f"difflogic model: {brief(str(e))}"
    from kspec.reference.difflogic import TRUTH

    truth = torch.tensor(TRUTH, dtype=torch.float32, device=ctx.dev)

    def eager_hard(x):  # torch eager, hard layers: one-hot argmax tables
        for logits, a, b in wiring:
            t = torch.nn.functional.one_hot(logits.argmax(-1), 16).float() @ truth
            xa, xb = x[:, a.long()], x[:, b.long()]
            x = t[:, 0] * (1 - xa) * (1 - xb) + t[:, 1] * (1 - xa) * xb + t[:, 2] * xa * (1 - xb) + t[:, 3] * xa * xb
        return x.reshape(x.shape[0], PACKED_K, -1).sum(-1)

    def float_hard(x):  # kspec's float path: the hard layers on fp32 activations
        for m in layers:
            x = m(x)
        return x.reshape(x.shape[0], PACKED_K, -1).sum(-1)

    rows = []
    for B in batches:
        g = torch.Generator(device=ctx.dev).manual_seed(ctx.args.seed + 7)
        bits = (torch.rand(B, PACKED_IN, device=ctx.dev, generator=g) < 0.5)
        with torch.no_grad():
            want = float_hard(bits[:min(B, CHECK_PACKED)].float()).round().to(torch.int32)
        for w in (32, 64):
            words = kspec.ops.difflogic_pack(bits, w)  # packed once, outside the timing (the input's format)

            def packed(words=words, B=B, config=None):
                x = words
                for logits, a, b in wiring:
                    x = call("difflogic.packed.fwd", x, logits, a, b, batch=B, config=config)[0]
                return call("difflogic.packed.group_sum", x,
                            out=(torch.empty(B, PACKED_K, dtype=torch.int32, device=ctx.dev),))[0]

            impls = [("kspec packed", "kspec", packed),
                     (f"kspec packed {ROWS_CONFIG}", "kspec", lambda packed=packed: packed(config=ROWS_CONFIG))]
            # The whole network in one op (difflogic.packed.net), each config in the same process: algo=layers
            # is the per-layer path above in one call, algo=chunked the persistent kernel over chunks in L2.
            # The wires are checked once above (kspec.ops.difflogic_packed_net checks them per call, a host sync).
            net_in = [list(t) for t in zip(*wiring)]

            def net(words=words, B=B, cfg=None):
                return call("difflogic.packed.net", words, *net_in, config=cfg,
                            out=(torch.empty(B, PACKED_K, dtype=torch.int32, device=ctx.dev),))[0]

            impls += [(f"kspec net {cfg}", "kspec", lambda net=net, cfg=cfg: net(cfg=cfg))
                      for cfg in ctx.args.difflogic_net_configs.split(";") if cfg.strip()]
            if B <= FLOAT_MAX_B and w == 32:
                impls += [("kspec float (hard)", "kspec", lambda b=bits: float_hard(b.float())),
                          ("torch eager (hard)", "peer", lambda b=bits: eager_hard(b.float()))]
            if peer is not None:
                impls.append(("difflogic 0.1.0 packed", "peer",
                              lambda b=bits, w=w: peer(peer_mod.PackBitsTensor(b, bit_count=w))))
            for name, impl, fn in impls:
                row = {"family": "difflogic.packed", "shape": f"B={B}", "w": w, "variant": name, "impl": impl,
                       "bytes": packed_bytes(B, w), "status": ""}
                if ctx.skipped(name):
                    row["status"] = "skipped"
                    rows.append(row)
                    continue
                try:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        got = fn()
                    torch.cuda.synchronize()
                    first_ms = (time.perf_counter() - t0) * 1e3
                    got = torch.as_tensor(got)[:CHECK_PACKED].round().to(torch.int32)
                    row["valid"] = bool(torch.equal(got, want))
                    row["status"] = "ok" if row["valid"] else "INVALID (counts differ from the float hard path)"
                    if row["valid"] or ctx.args.time_invalid:
                        with torch.no_grad():
                            row.update(timed(ctx, fn, lambda: None, first_ms))
                        row["gbps"] = row["bytes"] / (row["gpu_ms"] * 1e6)
                except Exception as e:  # noqa: BLE001
                    record_failure(row, e, ctx.args.verbose, torch)
                rows.append(row)
                print(f"bench: difflogic packed B={B} w={w} {name}: {row['status']}", file=sys.stderr, flush=True)
            del words
        del bits
        torch.cuda.empty_cache()
    for r in rows:
        peers = [k for k in rows if k["impl"] == "peer" and k["shape"] == r["shape"] and k["w"] == r["w"] and "gpu_ms" in k]
        if "gpu_ms" in r and peers:
            r["vs_peer"] = min(p["gpu_ms"] for p in peers) / r["gpu_ms"]
    cols = [("batch", "shape"), ("w", "w"), ("variant", "variant"),
            ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
            ("GB/s", lambda r: fmt(r.get("gbps"), ".0f")),
            ("× fastest peer", lambda r: fmt(r.get("vs_peer"), ".2f")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    notes = [f"{PACKED_IN} -> {PACKED_LAYERS} x {width} hard logic layers -> GroupSum({PACKED_K}) counts; the input"
             " packed once outside the timing; kspec packed: difflogic.packed.fwd per layer, difflogic.packed.group_sum"
             f" (its default config; {ROWS_CONFIG}: the rows kernel);"
             " kspec net CFG: difflogic.packed.net (the whole network in one op) with that config;"
             " kspec float (hard) and torch eager (hard): fp32 activations, only where B <= 2^14 (64 GB at 2^18);"
             " difflogic 0.1.0 packed: PackBitsTensor through its eval-mode LogicLayers and GroupSum (it packs"
             " wrongly unless w divides B, issue 30).",
             f"validation: the counts of the first {CHECK_PACKED} samples equal the kspec float hard path's;"
             " GB/s: the words' floor (each layer's input once, its output once); issue 30's target: >= 5x the peer."]
    if why:
        notes.append(f"peer absent: {why}")
    return rows, Section("difflogic: packed inference", cols, rows, notes)


# ---- (c) the CA: 16x16x8 checkerboard, T = 20, one BPTT training step ----

CA_T, CA_HW = 20, 16
CA_TOL = 1e-3  # issue 30: the 20-step BPTT gradient within 1e-3 (fp32)


def torch_ca(torch, truth):
    """The same CA in torch eager (kspec.reference.difflogic's maths as torch ops, autograd for the
    backward): a rollout(state, steps) of a kspec.nn.DiffLogicCA's parameters and wiring."""
    def tables(logits):
        return torch.softmax(logits, dim=-1) @ truth  # (..., 4)

    def gate(t, xa, xb):
        return t[..., 0] * (1 - xa) * (1 - xb) + t[..., 1] * (1 - xa) * xb + t[..., 2] * xa * (1 - xb) + \
            t[..., 3] * xa * xb

    def rollout(ca, state, steps):
        B, H, W, C = state.shape
        K, P = ca.n_kernels, ca.perceive[-1]
        wires = ca.wires.long()
        perm = ca.perm.long()
        pt = [tables(ca.perception_logits[:, a:b]) for a, b in _spans(ca.perceive)]  # (K, width, 4)
        ut = [tables(ca.update_logits[a:b]) for a, b in _spans(ca.update)]
        cols = _spans(ca.perceive[1:] + ca.update)
        for _ in range(steps):
            padded = torch.nn.functional.pad(state.permute(0, 3, 1, 2), (1, 1, 1, 1),
                                             mode="circular" if ca.periodic else "constant")
            patches = torch.stack([padded[:, :, dy:dy + H, dx:dx + W] for dy in range(3) for dx in range(3)], -1)
            x = patches.permute(0, 2, 3, 1, 4).reshape(B * H * W * C, 1, 9)  # (N C, 1, 9)
            x = gate(pt[0], x[..., perm], x[..., 4:5])  # (N C, K, 8)
            for (a, b), t in zip(cols[:len(ca.perceive) - 1], pt[1:]):
                x = gate(t, x[..., wires[0, a:b]], x[..., wires[1, a:b]])
            perc = x.reshape(B * H * W, C, K, P).transpose(2, 3).reshape(B * H * W, C * P * K)
            u = torch.cat([state.reshape(B * H * W, C), perc], dim=1)
            for (a, b), t in zip(cols[len(ca.perceive) - 1:], ut):
                u = gate(t, u[:, wires[0, a:b]], u[:, wires[1, a:b]])
            state = u.reshape(B, H, W, C)
        return state

    return rollout


def _peer_layer(torch, peer_mod, n_in, a, b):
    """A difflogic 0.1.0 LogicLayer (its CUDA kernels) on the wiring (a, b): its `indices` replaced and the
    reader lists its backward reads rebuilt the way its constructor builds them from `indices`; its `weights`
    parameter removed, rollout() sets them per call from the kspec CA's logits (so the gradients land there)."""
    m = peer_mod.LogicLayer(n_in, a.numel(), device=a.device.type, implementation="cuda")
    a, b = a.long().contiguous(), b.long().contiguous()
    m.indices = (a, b)
    readers = [[] for _ in range(n_in)]
    for g, (i, j) in enumerate(zip(a.tolist(), b.tolist())):
        readers[i].append(g)
        readers[j].append(g)
    m.given_x_indices_of_y_start = torch.tensor([0] + [len(r) for r in readers], device=a.device).cumsum(0)
    m.given_x_indices_of_y = torch.tensor([g for r in readers for g in r], dtype=torch.int64, device=a.device)
    del m.weights
    return m


def difflogic_ca(torch, peer_mod, ca):
    """The CA of a kspec.nn.DiffLogicCA from difflogic 0.1.0 LogicLayers: the K perception kernels as one
    layer per depth with block wiring (kernel k's gates read its own block of the layer below; the first
    layer's gate (k, g) reads (neighbour perm[g], centre)) on each cell and channel's 9 values, then the
    update network's layers on [state | perception]; rollout(state, steps) as torch_ca's."""
    K, P = ca.n_kernels, ca.perceive[-1]
    wires, perm = ca.wires.long(), ca.perm.long()
    dev = wires.device
    blocks = torch.arange(K, device=dev)[:, None]
    cols = _spans(ca.perceive[1:] + ca.update)
    layers = [_peer_layer(torch, peer_mod, 9, perm.repeat(K), torch.full((K * ca.perceive[0],), 4, device=dev))]
    for (lo, hi), w_in in zip(cols[:len(ca.perceive) - 1], ca.perceive[:-1]):
        layers.append(_peer_layer(torch, peer_mod, K * w_in, (blocks * w_in + wires[0, lo:hi]).reshape(-1),
                                  (blocks * w_in + wires[1, lo:hi]).reshape(-1)))
    n_perc = len(layers)
    n_in = ca.channels * (1 + P * K)
    for lo, hi in cols[len(ca.perceive) - 1:]:
        layers.append(_peer_layer(torch, peer_mod, n_in, wires[0, lo:hi], wires[1, lo:hi]))
        n_in = hi - lo

    def rollout(state, steps):
        for m, (lo, hi) in zip(layers, _spans(ca.perceive)):
            m.weights = ca.perception_logits[:, lo:hi].reshape(-1, 16)
        for m, (lo, hi) in zip(layers[n_perc:], _spans(ca.update)):
            m.weights = ca.update_logits[lo:hi]
        B, H, W, C = state.shape
        for _ in range(steps):
            padded = torch.nn.functional.pad(state.permute(0, 3, 1, 2), (1, 1, 1, 1),
                                             mode="circular" if ca.periodic else "constant")
            patches = torch.stack([padded[:, :, dy:dy + H, dx:dx + W] for dy in range(3) for dx in range(3)], -1)
            x = patches.permute(0, 2, 3, 1, 4).reshape(B * H * W * C, 9)
            for m in layers[:n_perc]:
                x = m(x)
            perc = x.reshape(B * H * W, C, K, P).transpose(2, 3).reshape(B * H * W, C * P * K)
            u = torch.cat([state.reshape(B * H * W, C), perc], dim=1)
            for m in layers[n_perc:]:
                u = m(u)
            state = u.reshape(B, H, W, C)
        return state

    return rollout


@contextlib.contextmanager
def _ca_bwd_config(config):
    """kspec's CA rollout with `config` for difflogic.ca.step.bwd (None: its default), for the old-vs-new rows:
    the rollout's calls go through kspec._difflogic_ca.call, wrapped here for the duration."""
    if config is None:
        yield
        return
    from kspec import _difflogic_ca

    inner = _difflogic_ca.call

    def call(op, *args, **kw):
        if op == "difflogic.ca.step.bwd":
            kw.setdefault("config", config)
        return inner(op, *args, **kw)

    _difflogic_ca.call = call
    try:
        yield
    finally:
        _difflogic_ca.call = inner


def _spans(widths):
    out, at = [], 0
    for w in widths:
        out.append((at, at + w))
        at += w
    return out


def run_ca(ctx):
    torch, kspec = ctx.torch, ctx.kspec
    from kspec.reference.difflogic import TRUTH

    eager = torch_ca(torch, torch.tensor(TRUTH, dtype=torch.float32, device=ctx.dev))
    batches = [2] if ctx.args.quick else [int(b) for b in ctx.args.difflogic_ca_batches.split(",")]
    torch.manual_seed(ctx.args.seed)
    ca = kspec.nn.DiffLogicCA(periodic=True, grad_clip=None, device=ctx.dev)
    with torch.no_grad():  # away from the pass-through init: every gate's gradient matters
        ca.perception_logits.add_(torch.randn_like(ca.perception_logits))
        ca.update_logits.add_(torch.randn_like(ca.update_logits))
    target = ((torch.arange(CA_HW, device=ctx.dev)[:, None] + torch.arange(CA_HW, device=ctx.dev)) % 2).float()
    # "readers=0": the step backward's first version (each update layer's input gradient tests every gate per
    # input), beside the default (readers=1, a readers CSR), in the same process.
    impls = [("kspec rollout", "kspec", lambda s: ca.rollout(s, CA_T)),
             ("kspec rollout readers=0", "kspec", lambda s: ca.rollout(s, CA_T)),
             ("kspec rollout (checkpoint)", "kspec", lambda s: ca.rollout(s, CA_T, checkpoint=True)),
             ("torch eager", "peer", lambda s: eager(ca, s, CA_T))]
    peer_mod, why = _peer()
    if peer_mod is not None:
        try:
            peer = difflogic_ca(torch, peer_mod, ca)
            impls.append(("difflogic 0.1.0 layers", "peer", lambda s: peer(s, CA_T)))
        except Exception as e:  # noqa: BLE001
            why = f"difflogic CA: {brief(str(e))}"
    rows = []
    for B in batches:
        g = torch.Generator(device=ctx.dev).manual_seed(ctx.args.seed + B)
        s0 = torch.rand(B, CA_HW, CA_HW, 8, device=ctx.dev, generator=g)

        def train_step(fn, config=None):
            ca.zero_grad()
            with _ca_bwd_config(config):
                out = fn(s0)
                ((out[..., 0] - target) ** 2).sum().backward()
            return out

        ref = None
        for name, impl, fn in impls:
            row = {"family": "difflogic.ca", "shape": f"{B}x{CA_HW}x{CA_HW}x8", "dtype": "float32", "variant": name,
                   "impl": impl, "kind": f"BPTT T={CA_T}", "cells": B * CA_HW * CA_HW * CA_T, "status": ""}
            if ctx.skipped(name):
                row["status"] = "skipped"
                rows.append(row)
                continue
            config = "threads=256,readers=0" if name.endswith("readers=0") else None
            try:
                t0 = time.perf_counter()
                train_step(fn, config)
                torch.cuda.synchronize()
                first_ms = (time.perf_counter() - t0) * 1e3
                grads = [ca.perception_logits.grad.clone(), ca.update_logits.grad.clone()]
                if ref is None:  # the first that ran is the others' yardstick: same maths, fp32 both
                    ref, row["max_error"] = grads, 0.0
                else:
                    row["max_error"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                           for a, b in zip(grads, ref))
                row["valid"] = row["max_error"] <= CA_TOL
                row["status"] = "ok" if row["valid"] else "INVALID"
                if row["valid"] or impl == "peer" or ctx.args.time_invalid:  # a peer's time stands (its errors shown)
                    row.update(timed(ctx, lambda fn=fn, config=config: train_step(fn, config), lambda: None, first_ms))
                    row["cells_per_s"] = row["cells"] / (row["gpu_ms"] * 1e-3)
            except Exception as e:  # noqa: BLE001
                record_failure(row, e, ctx.args.verbose, torch)
            rows.append(row)
            print(f"bench: difflogic CA B={B} {name}: {row['status']}", file=sys.stderr, flush=True)
    for r in rows:
        peers = [k for k in rows if k["impl"] == "peer" and k["shape"] == r["shape"] and "gpu_ms" in k]
        if "gpu_ms" in r and peers:
            r["vs_peer"] = min(k["gpu_ms"] for k in peers) / r["gpu_ms"]
    cols = [("shape (B×H×W×C)", "shape"), ("variant", "variant"), ("kind", "kind"),
            ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
            ("Mcells/s", lambda r: fmt(r["cells_per_s"] / 1e6 if "cells_per_s" in r else None, ".1f")),
            ("× fastest peer", lambda r: fmt(r.get("vs_peer"), ".2f")),
            ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    notes = [f"one training step: rollout of T = {CA_T} steps (periodic 16x16, the checkerboard architecture, logits"
             " near the pass-through init plus N(0, 1)), loss sum((s_T[..., 0] - checkerboard)^2), backward through"
             " time to both logits; kspec: kspec.nn.DiffLogicCA.rollout (T step kernels, T step backward kernels;"
             " checkpoint: states recomputed in the backward); torch eager: the same maths as torch ops with"
             " autograd; difflogic 0.1.0 layers (it has no CA): the same CA from its CUDA LogicLayers, the K"
             " perception kernels one layer per depth with block wiring, the update network's layers, on the"
             " same logits and wiring (its dx is wrong on self-paired gates: max rel err shows it).",
             "cells: B H W T cell updates per step; max rel err: both logits' gradients vs the first variant's"
             f" (target {CA_TOL:g}); issue 30's target: fwd+bwd >= 4x the peer."]
    if why:
        notes.append(f"difflogic peer absent: {why}")
    return rows, Section("difflogic: CA rollout with BPTT", cols, rows, notes)


def _feature_major(t):
    """The same values as a (B, n) view of a contiguous (n, B) tensor."""
    return t.t().contiguous().t()


def _run_one(ctx, torch, fn, weights, x, dy, dy_check, kind, ref, impl, dt, fm=False):
    if fm:
        x, dy, dy_check = _feature_major(x), _feature_major(dy), _feature_major(dy_check)
    xl = x.detach().clone().requires_grad_(kind != "fwd")  # clone keeps the strides

    def prep():
        xl.grad = None
        weights.grad = None

    def step(cot):
        if kind == "fwd":  # inference: no autograd graph for any implementation (the logits require grad)
            with torch.no_grad():
                return fn(xl)
        y = fn(xl)
        y.backward(cot)
        return y

    prep()
    t0 = time.perf_counter()
    y = step(dy_check)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    errs = {"y": _err(y, ref["y"])}
    if kind != "fwd":
        errs["dx"] = _err(xl.grad, ref["dx"]) if xl.grad is not None else float("inf")
        errs["dlogits"] = _err(weights.grad, ref["dlogits"]) if weights.grad is not None else float("inf")
    del y
    fwd_tol, bwd_tol = TOL[dt]
    out = {"errors": errs, "max_error": max(errs.values())}
    out["valid"] = out["max_error"] <= (fwd_tol if kind == "fwd" else bwd_tol)
    out["status"] = "ok" if out["valid"] else "INVALID"
    if out["valid"] or impl != "kspec" or ctx.args.time_invalid:
        out.update(timed(ctx, lambda: step(dy), prep, first_ms))
    return out


def _report(ctx, rows, notes, why):
    peak = ctx.args.peak_tbps
    cols = [
        ("shape (B×in→out)", "shape"), ("dtype", "dtype"), ("variant", "variant"), ("kind", "kind"),
        ("gpu ms", lambda r: fmt(r.get("gpu_ms"), ".3f")), ("ev ms", lambda r: fmt(r.get("ev_ms"), ".3f")),
        ("GB/s", lambda r: fmt(r.get("gbps"), ".0f")),
        (f"% of {peak:g} TB/s", lambda r: fmt(r.get("pct_of_peak"), ".0f")),
    ]  # then report.PEER_COLUMNS (speed-up, error, status)
    notes = list(notes) + [
        "kspec: kspec.nn.LogicLayer (training mode: the soft layer; wiring checked and its consumers CSR built"
        " once), x and dy row-major as given: fwd (no gradient: torch.no_grad) the row-major forward op, whose"
        " staged kernel reads x once (whole rows in shared memory; where a row does not fit, e.g. 64k fp32, x"
        " is transposed as in training); fwd+bwd: x transposed once (difflogic.transpose) to the feature-major"
        " kernels, y feature-major, dy transposed, dx written row-major by the backward (timed); kspec"
        " transpose: row_major='transpose', the transpose path in the forward too (the old default's fwd);"
        " kspec staged: row_major='staged', the staged forward in training too, x and dy transposed in the"
        " backward; kspec row-major direct:"
        " row_major='direct', the row-major ops (staged forward, the backward's gathers within rows); kspec"
        " row-major flat: the same with the forward's config stage=0 (the old gather kernel); kspec torch transpose: torch's"
        " x.t().contiguous() in front instead of kspec's (dx copied back by autograd); kspec feature-major: the"
        " same layer handed x.t() of a contiguous"
        " (n_in, B) and dy likewise (difflogic's layout: its kernels run along the batch; y, dx feature-major;"
        " its default configs: batch-tiled, lanes 16 forward, 32 backward with its readers' loads a step ahead, ahead 1);"
        " kspec feature-major lanes=L: the same"
        " ops with config threads=256,lanes=L in both (0: the flat kernels, a thread per element; else the"
        " batch-tiled ones, L threads of 16 bytes per row and tile), the backward's ahead=0 (the loads in the"
        " old order); kspec feature-major lanes=L ahead: the same with ahead=1. kspec staged pool=P (t128: 128"
        " threads): the staged forward writing xt, the backward's config pool=P (a block's P inputs handed out on"
        " demand; lanes 32, ahead 1); kspec staged cluster=C: the forward's config stage=C (a row staged across a"
        " cluster of C CTAs; xt then by a transpose), the default backward; kspec transpose pool=P: the default"
        " path (x transposed) with the backward's pool=P. difflogic 0.1.0:"
        " LogicLayer(implementation="
        "'cuda'), fp32 only, synchronizes after every kernel.",
        f"validation: y, dx and dlogits of the first {CHECK_SAMPLES} samples (dy zero elsewhere) vs the float64"
        " reference, before timing; difflogic's dx differs on inputs of self-paired gates (its bug, issue 30).",
        "bytes: a floor, x and y once, the backward dy, x again and dx (logits 64 B a gate); a gate reads two"
        " rows of x, so the forward moves up to 1.5x the floor where L2 misses the second reader; measured anchor (issue 30, H100):"
        " difflogic 64k→64k, B = 1024, fp32: fwd 1.101 ms, fwd+bwd 4.260 ms.",
    ]
    return peer_report("difflogic: logic gate layer", cols, rows, notes, why, targets(rows, peak))


def targets(rows, peak) -> list:
    lines = [f"targets (issue 30): fwd >= {FWD_PCT:.0f}% of {peak:g} TB/s; fwd+bwd >= {FWDBWD_VS_PEER:g}x difflogic"
             " (fp32):"]
    for r in rows:
        if r["impl"] != "kspec" or "gpu_ms" not in r:
            continue
        line = f"  {r['variant']} {r['shape']} {r['dtype']} {r['kind']}: {r['gpu_ms']:.3f} ms, {r['pct_of_peak']:.0f}%"
        if r["kind"] == "fwd":
            line += " ok" if r["pct_of_peak"] >= FWD_PCT else " MISSED"
        else:
            p = next((k for k in rows if k["variant"].startswith("difflogic") and k["shape"] == r["shape"]
                      and k["dtype"] == r["dtype"] and k["kind"] == r["kind"] and "gpu_ms" in k), None)
            if p:
                ratio = p["gpu_ms"] / r["gpu_ms"]
                line += f"; vs difflogic {ratio:.2f}x {'ok' if ratio >= FWDBWD_VS_PEER else 'MISSED'}"
        lines.append(line)
    return lines
