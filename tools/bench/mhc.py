"""The mhc benchmark (issue 34): manifold-constrained hyper-connections, bf16, T = 16384 (B = 4, S = 4096),
n = 4, D = 4096, t_max 20: the pre op, the post op, a whole layer (pre, an identity sublayer, post) and the
boundary between two layers (post of one, pre of the next: kspec's fused mhc_post_pre against kspec's post
then pre), forward and forward+backward, kspec against the same math in torch eager and torch.compile and
Liger's LigerMHC functions (liger-kernel 0.8.5, when importable), in one process. A second table: the decode
shape (T = 8, same n, D), host µs per call beside torch eager's single op."""
from __future__ import annotations

import sys

from .common import Section, brief, record_failure, short_error
from .dispatch import host_us
from .report import fmt, peer_report

FAMILY = "mhc"
DESCRIPTION = "mHC pre/post/layer: kspec.ops.mhc_pre/mhc_post against torch eager, torch.compile and LigerMHC"

EPS, T_MAX = 1e-6, 20
CHECK_TOKENS = 64   # tokens compared with the float64 reference (upstream gradients zero on the others)
FWD_TOL, BWD_TOL = 1e-2, 2e-2  # bf16 outputs (issue 34: 1e-2), max|err| / max|ref|
TARGET_PCT = 80.0   # issue 34: >= 80% of 3 TB/s on the bytes each op moves
LAYER_VS_COMPILE = 3.0  # issue 34: the layer's fwd+bwd >= 3x torch.compile
DECODE_T = 8        # issue 34's small-batch decode shape: host µs per call <= torch eager's single op
UNFUSED = "kspec post then pre"  # the post_pre rows' second kspec variant
PRE_KERNELS = "kspec pre.fwd "   # the pre fwd rows of each of pre.fwd's kernels by config (see pre_kernel_configs)
PRE_BWD_KERNELS = "kspec pre.bwd "  # the pre fwd+bwd rows of each of pre.bwd's algos by config (pre_bwd_configs)
POST_VEC8 = "kspec post vec 8"   # the post fwd and fwd+bwd rows of mhc.post.fwd/.bwd at vec=8 (16-byte loads)
POST_PRE_KERNELS = "kspec post_pre "  # the post_pre fwd rows of mhc.post_pre.fwd's kernels by config


def add_arguments(p):
    p.add_argument("--mhc-shape", metavar="TxNxD", default="16384x4x4096", help="mhc: tokens x streams x dim")
    p.add_argument("--mhc-ops", default="pre,post,layer,post_pre",
                   help="mhc: which rows to time, of pre, post, layer, post_pre (comma-separated)")


def min_bytes(op, kind, T, n, D, s=2):
    """Each tensor once: x = T n D s, y = f = T D s. pre fwd reads x, writes y; its backward reads dy and
    x, writes dx. post fwd reads x and f, writes out; its backward reads dout, x, f, writes dx, df. The layer
    adds them, its pre backward also reading the post's dx (issue 34's 1.75 GB). Per-token coefficients
    (100 B a token) and the fp32 parameters are left out. post_pre (post of layer l, pre of l + 1) reads x
    and f, writes x_next and y (unfused, pre reads x_next again: one x more); its backward reads dx_next, dy,
    x_next, x and f, writes dx and df."""
    x, y = T * n * D * s, T * D * s
    pre_f, pre_b, post_f, post_b = x + y, 2 * x + y, 2 * x + y, 3 * x + 2 * y
    if op == "post_pre":
        return 2 * x + 2 * y if kind == "fwd" else 6 * x + 5 * y
    if op == "pre":
        return pre_f if kind == "fwd" else pre_f + pre_b
    if op == "post":
        return post_f if kind == "fwd" else post_f + post_b
    return pre_f + post_f if kind == "fwd" else pre_f + post_f + post_b + pre_b + x


def pre_kernel_configs(n, D, dtype="bf16"):
    """{variant: config} for mhc.pre.fwd's two kernels (api/ops/mhc/op.cpp, the `algo` axis): algo=simt
    (mhc_pre.cuh, the default before sm_80) at 128 threads and 4 tokens a block where they fit, and algo=mma
    (mhc_pre_mma.cuh, tensor cores) at each legal token tile: 64 only for 16-bit x with D % 8 == 0, at most
    12 accumulator tiles (tokens / 16 x ceil(M / 8)); algo=mma_warp_heads (each warp its own tokens' heads, then
    their y) at 32 and 64 of those tiles, 16-bit x with M <= 32 (n <= 4)."""
    m = n * n + 2 * n
    out = {PRE_KERNELS + "simt": f"algo=0,threads=128,tokens={4 if 4 * max(m, n * n) <= 128 else 1}"}
    legal = [tok for tok in (16, 32, 64)
             if (tok < 64 or (dtype != "f32" and D % 8 == 0)) and tok // 16 * -(-m // 8) <= (10 if dtype == "f32" else 12)]
    for tok in legal:
        out[f"{PRE_KERNELS}mma {tok}"] = f"algo=1,threads=128,tokens={tok}"
    if dtype != "f32" and m <= 32:
        for tok in (32, 64):
            if tok in legal:
                out[f"{PRE_KERNELS}mma_warp_heads {tok}"] = f"algo=2,threads=128,tokens={tok}"
    return out


def pre_ring_configs(n, D, dtype="bf16"):
    """{variant: config} for mhc.pre.fwd's algo=mma_ring (api/ops/mhc/op.cpp): algo=mma_warp_heads with the
    projection's rows of x through a cp.async ring in shared memory, 3 chunks ahead (the same bits), at 16 and 32
    tokens: 16-bit x in 16-byte groups (D % 8 == 0) with M <= 32 (n <= 4)."""
    if dtype == "f32" or D % 8 or n * n + 2 * n > 32:
        return {}
    return {f"{PRE_KERNELS}mma_ring {tok}": f"algo=3,threads=128,tokens={tok}" for tok in (16, 32)}


def pre_bwd_configs(n, D):
    """{variant: config} for mhc.pre.bwd's `algo` axis (api/ops/mhc/op.cpp): algo=simt (mhc_pre.cuh), algo=mma
    (the heuristic's for 16-bit x), the sums over tokens as one GEMM a part and dx's du = dm·Φ on tensor cores
    (mhc_pre_bwd_mma.cuh) after the SIMT token kernel's first pass (128 threads, 4 tokens where they fit), and
    algo=mma_tokens, that first pass on tensor cores too (mhc_pre_bwd_token_mma.cuh) at its largest legal token
    tile: x in 16-byte groups (D % 8 == 0), n x tokens / 16 <= 8 rows of x a lane, plus the accumulator tiles
    <= 16, 16 tokens at n = 3; and algo=mma_fused at the same tile (M <= 24),
    mma_tokens' token pass, then dx and the sums over tokens from one pass over x (mhc_pre_bwd_fused_mma.cuh),
    and algo=mma_fused_warp_heads, that with the token pass's heads per warp."""
    m = n * n + 2 * n
    tokens = 4 if 4 * max(m, n * n) <= 128 and 4 * (n + m) <= 112 else 1
    out = {PRE_BWD_KERNELS + name: f"algo={algo},threads=128,tokens={tokens}" for name, algo in (("simt", 0), ("mma", 1))}
    for tok in (64, 32, 16):
        rows = tok // 16 * n
        if D % 8 == 0 and rows <= 8 and rows + tok // 16 * -(-m // 8) <= 16 and (n != 3 or tok == 16):
            out[f"{PRE_BWD_KERNELS}mma_tokens {tok}"] = f"algo=2,threads=128,tokens={tok}"
            if m <= 24:
                out[f"{PRE_BWD_KERNELS}mma_fused {tok}"] = f"algo=3,threads=128,tokens={tok}"
                out[f"{PRE_BWD_KERNELS}mma_fused_warp_heads {tok}"] = f"algo=4,threads=128,tokens={tok}"
            break
    return out


def pre_bwd_ring_configs(n, D):
    """{variant: config} for mhc.pre.bwd's algo=mma_fused_ring (api/ops/mhc/op.cpp): mma_fused_warp_heads with the
    token pass's rows through a cp.async ring in dynamic shared memory (the same bits), at the tile pre_bwd_configs
    gives mma_fused_warp_heads."""
    return {name.replace("mma_fused_warp_heads", "mma_fused_ring"): config.replace("algo=4", "algo=5")
            for name, config in pre_bwd_configs(n, D).items() if "mma_fused_warp_heads" in name}


def pre_bwd_ahead_configs(n, D):
    """{variant: config} for mhc.pre.bwd's algo=mma_fused_ahead and algo=mma_fused_phi_ring (api/ops/mhc/op.cpp):
    mma_fused_warp_heads with the fused kernel's per-token coefficients loaded a step ahead, whole 8-byte dx stores
    and the parts from the last; and that with the token pass's phi and gamma through a per-warp cp.async ring (the
    same bits, both), at mma_fused_warp_heads' tile and 16 tokens (the token pass's blocks twice as many, fewer
    registers a thread)."""
    out = {}
    for name, config in pre_bwd_configs(n, D).items():
        if "mma_fused_warp_heads" in name:
            tok = int(name.rsplit(" ", 1)[1])
            for label, algo in (("mma_fused_ahead", 6), ("mma_fused_phi_ring", 7)):
                for t in sorted({tok, 16}, reverse=True):
                    out[f"{PRE_BWD_KERNELS}{label} {t}"] = f"algo={algo},threads=128,tokens={t}"
    return out


def pre_bwd_slice_configs(n, D):
    """{variant: config} for mhc.pre.bwd's algo=mma_slice (api/ops/mhc/op.cpp): mma_fused_ahead's token pass, then
    one block per 128 columns walking every token (mhc_pre_bwd_slice_mma.cuh: 4 groups of 4 warps over ranges of
    the tokens, each step's dm, c_v and H_pre shared by a group through a 6-step cp.async ring, dphi and dgamma
    written once, no partial sums over parts), at mma_fused_warp_heads' tile and 16 tokens; and algo=mma_slice_du1
    (9), that with du = dm·Φ in one TF32 mma instead of three, at that tile."""
    out = {name.replace("mma_fused_ahead", "mma_slice"): config.replace("algo=6", "algo=8")
           for name, config in pre_bwd_ahead_configs(n, D).items() if "mma_fused_ahead" in name}
    return {**out, **{name.replace("mma_slice", "mma_slice_du1"): config.replace("algo=8", "algo=9")
                      for name, config in list(out.items())[:1]}}


def pre_bwd_sync_configs(n, D):
    """{variant: config} for mhc.pre.bwd's algo=mma_slice_du1_nb (10, the heuristic's where nD >= 12288) and
    mma_slice_du1_mb (11): mma_slice_du1 with each group of 4 warps under its own named barrier / mbarrier instead of
    one block barrier a step (the same bits), at mma_slice_du1's tile."""
    out = {}
    for name, config in pre_bwd_slice_configs(n, D).items():
        if "mma_slice_du1" in name:
            tok = int(name.rsplit(" ", 1)[1])
            out[f"{PRE_BWD_KERNELS}mma_slice_du1_nb {tok}"] = config.replace("algo=9", "algo=10")
            out[f"{PRE_BWD_KERNELS}mma_slice_du1_mb {tok}"] = config.replace("algo=9", "algo=11")
    return out


def post_pre_kernel_configs(n, D):
    """{variant: config} for mhc.post_pre.fwd's tensor-core kernels (api/ops/mhc/op.cpp, the `algo` axis; the
    SIMT kernel is the 'kspec' row): algo=mma and algo=mma_warp_heads (M <= 32) at the largest legal token tile,
    x in 16-byte groups (D % 8 == 0) and n x tokens / 16 <= 4 (16 tokens up to n = 7)."""
    if D % 8:
        return {}
    tok = next((t for t in (64, 32, 16) if n * t // 16 <= 4 or (t == 16 and n <= 7)), None)
    if tok is None:
        return {}
    out = {f"{POST_PRE_KERNELS}mma {tok}": f"algo=1,threads=128,tokens={tok}"}
    if n * n + 2 * n <= 32:
        out[f"{POST_PRE_KERNELS}mma_warp_heads {tok}"] = f"algo=2,threads=128,tokens={tok}"
    return out


def _pre_with_bwd_config(ctx, config):
    """pre(x, phi, alpha, bias) -> (y, h_pre, h_post, r): mhc.pre.fwd by its heuristic, its backward
    mhc.pre.bwd at `config`, both through kspec.call."""
    torch, call = ctx.torch, ctx.kspec.call

    class Pre(torch.autograd.Function):
        @staticmethod
        def forward(fc, x, phi, alpha, bias):
            fc.set_materialize_grads(False)
            y, h_pre, h_post, r, inv, h = call("mhc.pre.fwd", x, phi, alpha, bias, None)
            fc.save_for_backward(x, phi, alpha, bias, inv, h)
            return y, h_pre, h_post, r

        @staticmethod
        def backward(fc, dy, dh_pre, dh_post, dr):
            x, phi, alpha, bias, inv, h = fc.saved_tensors
            dy = dy.contiguous() if dy is not None else torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype,
                                                                     device=x.device)
            dx, dphi, dalpha, dbias, _ = call("mhc.pre.bwd", dy, x, phi, alpha, bias, None, inv, h, dh_pre, dh_post,
                                              dr, None, config=config)
            return dx, dphi, dalpha, dbias

    return lambda x, phi, alpha, bias: Pre.apply(x, phi, alpha, bias)


def _post_with_config(ctx, config):
    """post(x, f, h_post, r) -> out: mhc.post.fwd and mhc.post.bwd at `config`, both through kspec.call."""
    torch, call = ctx.torch, ctx.kspec.call

    class Post(torch.autograd.Function):
        @staticmethod
        def forward(fc, x, f, h_post, r):
            fc.save_for_backward(x, f, h_post, r)
            return call("mhc.post.fwd", x, f, h_post, r, config=config)[0]

        @staticmethod
        def backward(fc, dout):
            x, f, h_post, r = fc.saved_tensors
            return tuple(call("mhc.post.bwd", dout.contiguous(), x, f, h_post, r, config=config))

    return Post.apply


def torch_sinkhorn(torch, z, eps=EPS, t_max=T_MAX):
    """Issue 34's Sinkhorn-Knopp on (..., n, n): softmax over k + eps, columns (sum over j), then t_max - 1
    times rows, columns."""
    a = torch.softmax(z, dim=-1) + eps
    a = a / (a.sum(dim=-2, keepdim=True) + eps)
    for _ in range(t_max - 1):
        a = a / (a.sum(dim=-1, keepdim=True) + eps)
        a = a / (a.sum(dim=-2, keepdim=True) + eps)
    return a


def _acc(torch, x):
    """x in the accumulation dtype: fp32 for 16-bit inputs (fp64 stays fp64: the CPU test's)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def torch_pre(torch, x, phi, alpha, bias, gamma, eps=EPS, t_max=T_MAX):
    """The pre op in torch, fp32 math: (y like x, h_pre, h_post, r)."""
    n = x.shape[-2]
    v = _acc(torch, x).flatten(-2)
    inv = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    m = (v if gamma is None else v * gamma) @ phi.t()
    a = torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])
    h = inv * a * m + bias
    h_pre = torch.sigmoid(h[..., :n]) + eps
    h_post = 2 * torch.sigmoid(h[..., n:2 * n])
    r = torch_sinkhorn(torch, h[..., 2 * n:].unflatten(-1, (n, n)), eps, t_max)
    y = (h_pre[..., None] * _acc(torch, x)).sum(dim=-2).to(x.dtype)
    return y, h_pre, h_post, r


def torch_post(torch, x, f, h_post, r):
    """out[k] = h_post[k] f + sum_j r[j, k] x[j], fp32 math, in x's dtype."""
    xa = _acc(torch, x)
    out = h_post[..., None] * f.to(xa.dtype)[..., None, :] + torch.einsum("...jk,...jd->...kd", r.to(xa.dtype), xa)
    return out.to(x.dtype)


def _inputs(torch, dev, T, n, D, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    M = n * n + 2 * n

    def rn(*shape, scale=1.0, shift=0.0, dtype=torch.float32):
        return (torch.randn(*shape, device=dev, generator=g) * scale + shift).to(dtype)

    bf = torch.bfloat16
    return dict(x=rn(T, n, D, dtype=bf), f=rn(T, D, dtype=bf), phi=rn(M, n * D, scale=(n * D) ** -0.5),
                alpha=rn(3, scale=0.1, shift=1.0), bias=rn(M, scale=0.1),
                h_post=2 * torch.sigmoid(rn(T, n)), h_res=torch.softmax(rn(T, n, n), dim=-2),
                dy=rn(T, D, dtype=bf), dout=rn(T, n, D, dtype=bf))


def _ref(x, kind):
    """Float64 references on the first CHECK_TOKENS tokens: pre, post and layer outputs and gradients (the
    upstream gradients of those tokens; zero elsewhere in the validation call)."""
    from kspec.reference import mhc as ref

    c = CHECK_TOKENS
    a = {k: t[:c].double().cpu().numpy() if t.dim() > 1 and k != "phi" else t.double().cpu().numpy()
         for k, t in x.items()}
    args = (a["x"], a["phi"], a["alpha"], a["bias"])
    pre = ref.mhc_pre_fwd(*args)
    post_out = ref.mhc_post_fwd(a["x"], a["f"], a["h_post"], a["h_res"])
    pp_args = (a["x"], a["f"], a["h_post"], a["h_res"]) + args[1:]
    pp = ref.mhc_post_pre_fwd(*pp_args)
    out = {"pre": {"y": pre["y"]}, "post": {"out": post_out},
           "layer": {"out": ref.mhc_post_fwd(a["x"], pre["y"], pre["h_post"], pre["r"])},
           "post_pre": {"x_next": pp["x_next"], "y": pp["y"]}}
    if kind == "fwd":
        return out
    g = ref.mhc_post_pre_bwd(a["dout"], a["dy"], None, None, None, *pp_args)
    out["post_pre"].update(dx=g["dx"], df=g["df"], dh_post=g["dh_post"], dh_res=g["dr"], dphi=g["dphi"],
                           dalpha=g["dalpha"], dbias=g["dbias"])
    g = ref.mhc_pre_bwd(a["dy"], *args)
    out["pre"].update(dx=g["dx"], dphi=g["dphi"], dalpha=g["dalpha"], dbias=g["dbias"])
    g = ref.mhc_post_bwd(a["dout"], a["x"], a["f"], a["h_post"], a["h_res"])
    out["post"].update(dx=g["dx"], df=g["df"], dh_post=g["dh_post"], dh_res=g["dr"])
    p = ref.mhc_post_bwd(a["dout"], a["x"], pre["y"], pre["h_post"], pre["r"])
    g = ref.mhc_pre_bwd(p["df"], *args, dh_post=p["dh_post"], dr=p["dr"], dx_post=p["dx"])
    out["layer"].update(dx=g["dx"], dphi=g["dphi"], dalpha=g["dalpha"], dbias=g["dbias"])
    return out


def _err(got, want):
    import numpy as np

    got = got.detach().double().cpu().numpy()
    if got.shape != want.shape:
        got = got[:CHECK_TOKENS]
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_mhc_coeffs, liger_mhc_post_res, liger_mhc_pre
    except Exception as e:  # noqa: BLE001
        return None, f"liger-kernel (LigerMHC) not importable ({brief(str(e))})"
    return (liger_mhc_coeffs, liger_mhc_pre, liger_mhc_post_res), None


def _then(pre, post):
    """post_pre as post then pre: (x_next, y, h_pre, h_post, r)."""
    def post_pre(x, f, h_post, r, phi, alpha, bias):
        x_next = post(x, f, h_post, r)
        return (x_next,) + tuple(pre(x_next, phi, alpha, bias))
    return post_pre


def implementations(ctx, liger, n, D):
    """{name: (pre(x, phi, alpha, bias) -> (y, h_pre, h_post, r), post(x, f, h_post, r) -> out, post_pre(x, f,
    h_post, r, phi, alpha, bias) -> (x_next, y, ...))}; r is kspec's R[j, k] (stream j into k) for every
    implementation (Liger's h_res is its transpose). Only kspec fuses post_pre; UNFUSED is kspec's post then
    pre (post_pre rows only); the PRE_KERNELS variants are mhc.pre.fwd's kernels by config (pre fwd rows only)."""
    torch, K = ctx.torch, ctx.kspec.ops
    impls = {
        "kspec": (lambda x, phi, alpha, bias: K.mhc_pre(x, phi, alpha, bias), K.mhc_post),
        UNFUSED: (lambda x, phi, alpha, bias: K.mhc_pre(x, phi, alpha, bias), K.mhc_post),
        "torch eager": (lambda x, phi, alpha, bias: torch_pre(torch, x, phi, alpha, bias, None),
                        lambda x, f, hp, r: torch_post(torch, x, f, hp, r)),
    }
    cpre = torch.compile(lambda x, phi, alpha, bias: torch_pre(torch, x, phi, alpha, bias, None), dynamic=False)
    cpost = torch.compile(lambda x, f, hp, r: torch_post(torch, x, f, hp, r), dynamic=False)
    impls["torch.compile"] = (cpre, cpost)
    if liger is not None:
        coeffs, lpre, lpost = liger
        for label, phi_dtype in (("bf16 Φ", torch.bfloat16), ("fp32 Φ", torch.float32)):
            def pre(x, phi, alpha, bias, phi_dtype=phi_dtype):
                # Liger: phi [nD, M], alpha as three scalars, h_res = R^T
                hp, hq, hr = coeffs(x, phi.t().to(phi_dtype), bias, alpha[0], alpha[1], alpha[2], allow_fp32=False,
                                    tmax=T_MAX, rms_eps=EPS, pre_eps=EPS, sinkhorn_eps=EPS, post_mult=2.0)
                return lpre(x, hp), hp, hq, hr.transpose(-1, -2)

            impls[f"LigerMHC ({label})"] = (pre, lambda x, f, hp, r: lpost(x, f, hp, r.transpose(-1, -2)))
    for name, config in {**pre_kernel_configs(n, D), **pre_ring_configs(n, D)}.items():
        def pre(x, phi, alpha, bias, config=config):
            return ctx.kspec.call("mhc.pre.fwd", x, phi, alpha, bias, None, config=config)[:4]

        impls[name] = (pre, K.mhc_post)
    for name, config in {**pre_bwd_configs(n, D), **pre_bwd_ring_configs(n, D), **pre_bwd_ahead_configs(n, D),
                         **pre_bwd_slice_configs(n, D), **pre_bwd_sync_configs(n, D)}.items():
        impls[name] = (_pre_with_bwd_config(ctx, config), K.mhc_post)
    for name, config in post_pre_kernel_configs(n, D).items():
        def post_pre(x, f, hp, r, phi, alpha, bias, config=config):
            return ctx.kspec.call("mhc.post_pre.fwd", x, f, hp, r, phi, alpha, bias, None, config=config)[:5]

        impls[name] = (lambda x, phi, alpha, bias: K.mhc_pre(x, phi, alpha, bias), K.mhc_post, post_pre)
    if D % 8 == 0:
        impls[POST_VEC8] = (lambda x, phi, alpha, bias: K.mhc_pre(x, phi, alpha, bias),
                            _post_with_config(ctx, "threads=128,vec=8"))
    impls = {name: fns if len(fns) == 3 else (fns[0], fns[1], _then(fns[0], fns[1])) for name, fns in impls.items()}
    impls["kspec"] = impls["kspec"][:2] + (lambda x, f, hp, r, phi, alpha, bias: K.mhc_post_pre(x, f, hp, r, phi,
                                                                                                alpha, bias),)
    return impls


def run(ctx):
    torch = ctx.torch
    T, n, D = (int(v) for v in ctx.args.mhc_shape.split("x"))
    if ctx.args.quick:
        T = 2048
    liger, why = _liger()
    if why:
        print(f"bench: mhc: {why}", file=sys.stderr)
    x = _inputs(torch, ctx.dev, T, n, D, ctx.args.seed)
    refs = {kind: _ref(x, kind) for kind in ("fwd", "fwd+bwd")}
    # upstream gradients on the checked tokens only (the parameter gradients then are theirs alone)
    dy_check, dout_check = torch.zeros_like(x["dy"]), torch.zeros_like(x["dout"])
    dy_check[:CHECK_TOKENS], dout_check[:CHECK_TOKENS] = x["dy"][:CHECK_TOKENS], x["dout"][:CHECK_TOKENS]
    rows = []
    for name, fns in implementations(ctx, liger, n, D).items():
        for op in ("pre", "post", "layer", "post_pre"):
            if op not in ctx.args.mhc_ops.split(","):
                continue
            by_config = name.startswith(PRE_KERNELS) or name.startswith(PRE_BWD_KERNELS)
            post_pre_kernel = name.startswith(POST_PRE_KERNELS)
            if (name == UNFUSED and op != "post_pre") or (by_config and op != "pre") or (name == POST_VEC8
                                                                                         and op != "post"):
                continue
            if post_pre_kernel and op != "post_pre":
                continue
            kinds = (("fwd",) if name.startswith(PRE_KERNELS) or post_pre_kernel else ("fwd+bwd",) if by_config
                     else ("fwd", "fwd+bwd"))
            for kind in kinds:
                row = {"family": "mhc", "shape": f"T={T} n={n} D={D}", "op": op, "variant": name, "kind": kind,
                       "impl": "kspec" if name in ("kspec", UNFUSED, POST_VEC8) or by_config or post_pre_kernel
                       else "peer",
                       "bytes": min_bytes(op, kind, T, n, D), "status": ""}
                if ctx.skipped(name):
                    row["status"] = "skipped"
                    rows.append(row)
                    continue
                try:
                    row.update(_run_one(ctx, torch, x, fns, op, kind, refs[kind][op], dy_check, dout_check,
                                        row["impl"]))
                except Exception as e:  # noqa: BLE001  (a peer that fails is a result)
                    record_failure(row, e, ctx.args.verbose, torch)
                rows.append(row)
                # the times on the progress line too: a run cut short by its time limit still shows them
                times = f" gpu {row['gpu_ms']:.3f} ms, ev {row['ev_ms']:.3f} ms" if "gpu_ms" in row else ""
                print(f"bench: mhc {op} {name} {kind}: {row['status']}{times}", file=sys.stderr, flush=True)
    for r in rows:
        base = next((k for k in rows if k["variant"] == "kspec" and k["op"] == r["op"] and k["kind"] == r["kind"]
                     and "gpu_ms" in k), None)
        if "gpu_ms" in r:
            r["gbps"] = r["bytes"] / (r["gpu_ms"] * 1e6)
            r["pct_of_peak"] = 100.0 * r["bytes"] / (r["gpu_ms"] * 1e-3) / (ctx.args.peak_tbps * 1e12)
            if base:
                r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]
                r["kspec_speedup_ev"] = r["ev_ms"] / base["ev_ms"]
    data, sections = _report(ctx, rows, why)
    data["decode"] = decode_rows(ctx, n, D)
    return data, sections + [_decode_section(data["decode"])]


def _step(torch, x, fns, op, kind, dy, dout):
    """(step() -> outputs dict, prep) for one op and kind; leaves are fresh copies requiring grad."""
    leaves = {k: x[k].detach().clone().requires_grad_(kind != "fwd") for k in ("x", "f", "phi", "alpha", "bias",
                                                                               "h_post", "h_res")}
    L = leaves
    pre, post, post_pre = fns

    def prep():
        for t in leaves.values():
            t.grad = None

    def step():
        if op == "pre":
            y = pre(L["x"], L["phi"], L["alpha"], L["bias"])[0]
            res = {"y": y}
            if kind != "fwd":
                y.backward(dy)
        elif op == "post":
            out = post(L["x"], L["f"], L["h_post"], L["h_res"])
            res = {"out": out}
            if kind != "fwd":
                out.backward(dout)
        elif op == "post_pre":
            x_next, y = post_pre(L["x"], L["f"], L["h_post"], L["h_res"], L["phi"], L["alpha"], L["bias"])[:2]
            res = {"x_next": x_next, "y": y}
            if kind != "fwd":
                torch.autograd.backward([x_next, y], [dout, dy])
        else:
            y, _, h_post, r = pre(L["x"], L["phi"], L["alpha"], L["bias"])
            out = post(L["x"], y, h_post, r)  # an identity sublayer
            res = {"out": out}
            if kind != "fwd":
                out.backward(dout)
        if kind != "fwd":
            res.update({"d" + k: t.grad for k, t in leaves.items() if t.grad is not None})
        return res

    return step, prep


def _run_one(ctx, torch, x, fns, op, kind, ref, dy_check, dout_check, impl):
    step, prep = _step(torch, x, fns, op, kind, dy_check, dout_check)
    prep()
    got = step()
    torch.cuda.synchronize()
    errs = {k: _err(got[k], w) if got.get(k) is not None else float("inf") for k, w in ref.items()}
    del got
    out = {"errors": errs, "max_error": max(errs.values())}
    out["valid"] = out["max_error"] <= (FWD_TOL if kind == "fwd" else BWD_TOL)
    out["status"] = "ok" if out["valid"] else "INVALID"
    if out["valid"] or impl != "kspec" or ctx.args.time_invalid:
        step, prep = _step(torch, x, fns, op, kind, x["dy"], x["dout"])
        out.update(ctx.timer.time(step, prep))
    return out


def _report(ctx, rows, why):
    peak = ctx.args.peak_tbps
    cols = [
        ("op", "op"), ("variant", "variant"), ("kind", "kind"),
        ("gpu µs", lambda r: fmt(r["gpu_ms"] * 1e3 if "gpu_ms" in r else None, ".0f")),
        ("ev µs", lambda r: fmt(r["ev_ms"] * 1e3 if "ev_ms" in r else None, ".0f")),
        ("GB/s", lambda r: fmt(r.get("gbps"), ".0f")),
        (f"% of {peak:g} TB/s", lambda r: fmt(r.get("pct_of_peak"), ".0f")),
    ]
    notes = [
        "bytes: each tensor once (x = T·n·D·2, y = f = T·D·2; the layer's pre backward also reads the post's dx);"
        " GB/s and % from the gpu time. kspec ×: this row's time / kspec's (> 1: kspec faster).",
        f"validation: outputs and gradients of the first {CHECK_TOKENS} tokens (upstream gradients zero elsewhere) vs"
        f" the float64 reference, bounds {FWD_TOL:g} / {BWD_TOL:g} (max|err| / max|ref|), before timing; γ absent"
        " (Liger has none); eps 1e-6 each, t_max 20.",
        "Liger: Φ passed transposed ([nD, M]), α as three scalars, pre_eps 1e-6, its h_res = kspec's Rᵀ; measured"
        " (issue 34, H100): pre fwd 1.05 ms (bf16 Φ) / 1.42 (fp32 Φ), post fwd 1.44, layer fwd+bwd 16.5;"
        " torch.compile 1.47 / 4.65 / 13.7.",
        f"'{PRE_KERNELS}…': mhc.pre.fwd's kernels by config through kspec.call (forward only): algo=simt, the SIMT"
        " projection; algo=mma, the projection on tensor cores at 16, 32 or 64 tokens a block; algo=mma_warp_heads"
        " (M <= 32), the same with each warp running its own tokens' heads (Sinkhorn-Knopp by shuffles) and then"
        " their y; algo=mma_ring (the default at 32 tokens for x in 16-byte groups and M <= 32), that with the"
        " projection's rows of x through a cp.async ring in shared memory, 3 chunks ahead (the same bits).",
        f"'{PRE_BWD_KERNELS}…': pre fwd+bwd with mhc.pre.bwd by config through kspec.call (the forward the"
        " heuristic's): algo=simt, the SIMT kernels; algo=mma, dΦ and dγ from one GEMM S = dmᵀ·x a part and dx's"
        " du = dm·Φ on tensor cores; algo=mma_tokens (the default past M = 24), the token pass (m and"
        " <dy, x[i]>) on tensor cores too; algo=mma_fused, mma_tokens' token pass, then dx and the sums over tokens"
        " in one pass over x (x read twice in the backward instead of three times; the default for M <= 24);"
        " algo=mma_fused_warp_heads, that"
        " with the token pass's heads (the Sinkhorn-Knopp backward) run per warp; algo=mma_fused_ring, that with the"
        " token pass's rows through a cp.async ring in shared memory (the same bits); algo=mma_fused_ahead,"
        " mma_fused_warp_heads with the fused kernel's c_v and H_pre a step ahead, 8-byte dx stores and the parts"
        " from the last (the same bits); algo=mma_fused_phi_ring, that with the token pass's Φ and γ through a"
        " per-warp cp.async ring, 3 steps ahead (the same bits); both at 32 and 16 tokens; algo=mma_slice,"
        " mma_fused_ahead's token pass, then one block per 128 columns walking every token (its 4 groups of 4 warps"
        " sharing each step's dm through a 6-step cp.async ring; dΦ and dγ written once, no partial sums; dx the"
        " same bits); algo=mma_slice_du1, that with du = dm·Φ in one TF32 mma instead of three (dx within ~2^-11);"
        " algo=mma_slice_du1_nb (the default where nD >= 12288) / _mb, that with each group of 4 warps under its"
        " own named barrier / mbarrier (the same bits).",
        f"'{POST_VEC8}': post fwd and fwd+bwd with mhc.post.fwd/.bwd at vec=8 (8 consecutive d a thread, 16-byte"
        " loads and stores) through kspec.call; 'kspec' runs the heuristic's, vec=8 where it is valid.",
        f"'{POST_PRE_KERNELS}…': post_pre fwd with mhc.post_pre.fwd by config through kspec.call: the projection of"
        " x_next on tensor cores (algo=mma; algo=mma_warp_heads, the heads per warp); 'kspec' runs the SIMT kernel.",
        f"post_pre: post of layer l then pre of layer l + 1 (x_next and y compared; bytes the fused floor, so the"
        f" unfused rows' % shows the extra read of x_next); '{UNFUSED}' is kspec's two ops, the peers theirs.",
    ]
    return peer_report("mhc: bf16, n streams, t_max 20", cols, rows, notes, why, targets(rows, peak))


def targets(rows, peak) -> list:
    lines = [f"targets (issue 34): >= {TARGET_PCT:.0f}% of {peak:g} TB/s per op; layer fwd+bwd >= {LAYER_VS_COMPILE:g}x"
             " torch.compile:"]
    for r in rows:
        if r["impl"] != "kspec" or "gpu_ms" not in r:
            continue
        line = (f"  {r['op']}{' (' + r['variant'] + ')' if r['variant'] != 'kspec' else ''} {r['kind']}:"
                 f" {r['gpu_ms'] * 1e3:.0f} µs, {r['pct_of_peak']:.0f}%")
        if r["op"] == "post_pre":
            u = next((k for k in rows if k["variant"] == UNFUSED and k["kind"] == r["kind"] and "gpu_ms" in k), None)
            if r["variant"] == "kspec" and u:
                saved = (u["gpu_ms"] - r["gpu_ms"]) * 1e3
                line += f"; the fusion saves {saved:.0f} µs ({u['gpu_ms'] / r['gpu_ms']:.2f}x)"
        elif r["op"] != "layer" or r["kind"] == "fwd":
            line += " ok" if r["pct_of_peak"] >= TARGET_PCT else " MISSED"
        else:
            c = next((k for k in rows if k["variant"] == "torch.compile" and k["op"] == "layer"
                      and k["kind"] == r["kind"] and "gpu_ms" in k), None)
            ratio = c["gpu_ms"] / r["gpu_ms"] if c else None
            line += (f"; vs torch.compile {ratio:.2f}x {'ok' if ratio >= LAYER_VS_COMPILE else 'MISSED'}" if ratio
                     else "; torch.compile not timed")
        lines.append(line)
    return lines


# ---- the decode shape: host time per call ----

def decode_rows(ctx, n, D) -> list:
    """Issue 34's small-batch decode shape (T = DECODE_T, bf16, no gradient): median host µs per call of
    kspec.ops.mhc_pre, mhc_post and mhc_post_pre (dispatch.host_us: 2000 calls, no sync inside) beside torch
    eager's single op of the same size (F.rms_norm on [T, n·D]) and the plain kspec.call of mhc.pre.fwd
    (the floor of the Python path). Outputs checked against the float64 reference first."""
    torch, K = ctx.torch, ctx.kspec
    from kspec.reference import mhc as ref

    x = _inputs(torch, ctx.dev, DECODE_T, n, D, ctx.args.seed)
    a = (x["x"], x["phi"], x["alpha"], x["bias"])
    post_args = (x["x"], x["f"], x["h_post"], x["h_res"])
    w = torch.ones(n * D, device=ctx.dev, dtype=torch.bfloat16)
    xf = x["x"].view(DECODE_T, n * D)
    np_args = {k: t.double().cpu().numpy() for k, t in x.items()}
    want_pp = ref.mhc_post_pre_fwd(*(np_args[k] for k in ("x", "f", "h_post", "h_res", "phi", "alpha", "bias")))
    calls = [
        ("torch F.rms_norm [T, n·D]", "peer", lambda: torch.nn.functional.rms_norm(xf, (n * D,), w, EPS), None),
        ("kspec.call mhc.pre.fwd", "kspec", lambda: K.call("mhc.pre.fwd", *a, None), None),
        ("kspec.ops.mhc_pre", "kspec", lambda: K.ops.mhc_pre(*a),
         lambda o: _err(o[0], ref.mhc_pre_fwd(*(np_args[k] for k in ("x", "phi", "alpha", "bias")))["y"])),
        ("kspec.ops.mhc_post", "kspec", lambda: K.ops.mhc_post(*post_args),
         lambda o: _err(o, ref.mhc_post_fwd(*(np_args[k] for k in ("x", "f", "h_post", "h_res"))))),
        ("kspec.ops.mhc_post_pre", "kspec", lambda: K.ops.mhc_post_pre(*post_args, *a[1:]),
         lambda o: max(_err(o[0], want_pp["x_next"]), _err(o[1], want_pp["y"]))),
    ]
    rows = []
    with torch.no_grad():
        for name, impl, fn, check in calls:
            row = {"family": "mhc", "shape": f"T={DECODE_T} n={n} D={D}", "variant": name, "impl": impl,
                   "status": "ok"}
            try:
                if check is not None:
                    row["max_error"] = check(fn())
                    if not row["max_error"] <= FWD_TOL:
                        row["status"] = "INVALID"
                row["host_us"] = host_us(fn)
            except Exception as e:  # noqa: BLE001  (a failing row is a result)
                row["status"], row["error"] = "error", short_error(e)
            rows.append(row)
    peer = rows[0].get("host_us")
    for r in rows[1:]:
        if peer and "host_us" in r:
            r["vs_peer"] = r["host_us"] / peer
    return rows


def _decode_section(rows) -> Section:
    cols = [("call (no grad, bf16)", "variant"), ("host µs", lambda r: fmt(r.get("host_us"), ".1f")),
            ("/ F.rms_norm", lambda r: fmt(r.get("vs_peer"), ".2f")),
            ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
            ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else ""))]
    notes = [f"median host µs of one call over 2000 calls after 200 warm-ups, no sync inside (tools/bench/"
             f"dispatch.py's method), T = {DECODE_T}; under torch.no_grad the ops make one kspec.call of the forward op (the"
             " torch fast path), not the autograd surface.",
             "target (issue 34): kspec.ops.mhc_pre / mhc_post at or below F.rms_norm's host µs: "
             + ", ".join(f"{r['variant'].removeprefix('kspec.ops.')} {'ok' if r['vs_peer'] <= 1.0 else 'MISSED'}"
                         for r in rows if r["variant"].startswith("kspec.ops.") and "vs_peer" in r)]
    return Section(f"mhc decode shape: host µs per call, T = {DECODE_T}", cols, rows, notes)
