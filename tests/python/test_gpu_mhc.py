"""mhc through kspec.call: the schema as Python sees it (no GPU: op_info, the named regression cases,
compiling every op), and on a GPU every op against the float64 NumPy reference on [B, S, n, D] torch
tensors (n 1/4/8, D 37/128/4000, fp32 and bf16, each upstream gradient alone and all together, the
post op's dx added into the pre op's), pre.bwd bitwise deterministic, and a layer of pre, an identity
sublayer and post whose backward matches central differences through the reference chain.
(No torch wrappers yet: the Python surface is generated from the OpDef elsewhere.)"""
import numpy as np
import pytest

from helpers import TOL, load_reference, max_rel, mhc_layer_inputs, to_np, torch_or_skip

import kspec

ref = load_reference("mhc")

OPS = ["mhc.pre.fwd", "mhc.pre.bwd", "mhc.pre_only.fwd", "mhc.pre_only.bwd", "mhc.post.fwd", "mhc.post.bwd",
       "mhc.sinkhorn.fwd", "mhc.sinkhorn.bwd", "mhc.post_pre.fwd", "mhc.post_pre.bwd"]


def test_ops_are_registered_with_the_named_cases():
    assert set(OPS) <= set(kspec.list_ops())
    info = kspec.op_info("mhc.pre.bwd")
    assert [t["name"] for t in info["inputs"]] == ["dy", "x", "phi", "alpha", "bias", "gamma", "inv", "h", "dh_pre",
                                                   "dh_post", "dr", "dx_post"]
    assert [t["name"] for t in info["outputs"]] == ["dx", "dphi", "dalpha", "dbias", "dgamma"]
    cases = {c["name"]: dict(c["dims"]) for c in info["cases"]}
    for D in (37, 128, 1000, 2560, 4000, 7168):  # d_not_pow2 and the 32-of-128 regression
        assert any(d["D"] == D and d["n"] == 4 for d in cases.values()), D
    assert cases["dx_dgamma_multiblock"] == {"T": 1031, "n": 4, "D": 4000}
    assert {t["name"] for t in kspec.op_info("mhc.pre_only.fwd")["outputs"]} == {"y", "h_pre", "inv", "h"}


@pytest.mark.parametrize("op", OPS)
def test_every_op_compiles_without_a_gpu(op):
    params = {"n": 4} if "sinkhorn" in op else {"n": 4, "D": 37}
    reports = kspec.compile(op, dtype="f32" if "sinkhorn" in op else "bf16", arch="sm_90", **params)
    assert reports and all(r["spill_bytes"] == 0 for r in reports)


def test_bad_input_names_the_argument():
    with pytest.raises(kspec.InvalidArgument, match="t_max"):
        kspec.compile("mhc.pre.fwd", dtype="bf16", arch="sm_90", n=4, D=64, t_max=0)
    with pytest.raises(kspec.InvalidArgument, match="'n'"):
        kspec.compile("mhc.pre.fwd", dtype="bf16", arch="sm_90", n=9, D=64)


# ---- GPU ----



def _tol(dtype, bwd):
    """The one table's tolerance; fp32 gradients 1e-4 (issue 34: sums over tokens and Sinkhorn steps)."""
    base = TOL[str(dtype).split(".")[1]]
    return base * 10 if bwd and dtype == torch_or_skip().float32 else base


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(1, 64), (4, 37), (4, 128), (4, 4000), (8, 100)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_layer_forward_and_backward_match_reference(n, D, dtype_name):
    t = torch_or_skip()
    dtype = getattr(t, dtype_name)
    B, S = 2, 5
    T = B * S
    x, phi, alpha, bias, gam = mhc_layer_inputs(B, S, n, D, dtype, seed=n * 1000 + D)
    y, h_pre, h_post, r, inv, h = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam)
    xs = to_np(x).reshape(T, n, D)
    want = ref.mhc_pre_fwd(xs, to_np(phi), to_np(alpha), to_np(bias), to_np(gam))
    assert y.shape == (B, S, D) and r.shape == (B, S, n, n) and h.shape == (B, S, n * n + 2 * n)
    for name, got in (("y", y), ("h_pre", h_pre), ("h_post", h_post), ("r", r), ("inv", inv), ("h", h)):
        tol = _tol(dtype, False) if name == "y" else 1e-5 * (1 if dtype == t.float32 else 10)
        assert max_rel(got.reshape(want[name].shape), want[name]) <= tol, name
    f = y  # an identity sublayer
    (out,) = kspec.call("mhc.post.fwd", x, f, h_post, r)
    want_out = ref.mhc_post_fwd(xs, to_np(f).reshape(T, D), to_np(h_post).reshape(T, n), to_np(r).reshape(T, n, n))
    assert max_rel(out.reshape(T, n, D), want_out) <= _tol(dtype, False)
    dout = t.randn_like(out)
    dx_post, df, dh_post, dres = kspec.call("mhc.post.bwd", dout, x, f, h_post, r)
    pg = ref.mhc_post_bwd(to_np(dout).reshape(T, n, D), xs, to_np(f).reshape(T, D), to_np(h_post).reshape(T, n),
                          to_np(r).reshape(T, n, n))
    for name, got in (("dx", dx_post), ("df", df), ("dh_post", dh_post), ("dr", dres)):
        assert max_rel(got.reshape(pg[name].shape), pg[name]) <= _tol(dtype, True), "post " + name
    dx, dphi, dalpha, dbias, dgamma = kspec.call("mhc.pre.bwd", df, x, phi, alpha, bias, gam, inv, h, None, dh_post,
                                                 dres, dx_post)
    g = ref.mhc_pre_bwd(to_np(df).reshape(T, D), xs, to_np(phi), to_np(alpha), to_np(bias), to_np(gam),
                        dh_post=to_np(dh_post).reshape(T, n), dr=to_np(dres).reshape(T, n, n),
                        dx_post=to_np(dx_post).reshape(T, n, D))
    for name, got in (("dx", dx), ("dphi", dphi), ("dalpha", dalpha), ("dbias", dbias), ("dgamma", dgamma)):
        assert max_rel(got.reshape(g[name].shape), g[name]) <= _tol(t.float32 if name != "dx" else dtype, True), name


@pytest.mark.gpu
@pytest.mark.parametrize("given", ["dh_pre", "dh_post", "dr", "dx_post"])
def test_each_upstream_gradient_alone(given):
    t = torch_or_skip()
    B, S, n, D = 1, 9, 4, 96
    T = B * S
    x, phi, alpha, bias, gam = mhc_layer_inputs(B, S, n, D, t.float32, seed=7)
    _, _, _, _, inv, h = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam)
    up = {"dh_pre": t.randn(B, S, n).cuda(), "dh_post": t.randn(B, S, n).cuda(), "dr": t.randn(B, S, n, n).cuda(),
          "dx_post": t.randn(B, S, n, D).cuda()}
    up = {k: (v if k == given else None) for k, v in up.items()}
    dy = t.randn(B, S, D).cuda()
    grads = kspec.call("mhc.pre.bwd", dy, x, phi, alpha, bias, gam, inv, h, up["dh_pre"], up["dh_post"], up["dr"],
                       up["dx_post"])
    shapes = {"dh_pre": (T, n), "dh_post": (T, n), "dr": (T, n, n), "dx_post": (T, n, D)}
    want = ref.mhc_pre_bwd(to_np(dy).reshape(T, D), to_np(x).reshape(T, n, D), to_np(phi), to_np(alpha), to_np(bias),
                           to_np(gam), **{k: None if v is None else to_np(v).reshape(shapes[k]) for k, v in up.items()})
    for name, got in zip(("dx", "dphi", "dalpha", "dbias", "dgamma"), grads):
        assert max_rel(got.reshape(want[name].shape), want[name]) <= 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("n,t_max,eps", [(1, 20, 1e-6), (3, 1, 0.0), (4, 20, 0.0), (8, 20, 1e-6)])
def test_sinkhorn_matches_reference_with_saturated_logits(n, t_max, eps):
    t = torch_or_skip()
    logits = (30 * (2 * t.rand(33, n, n) - 1)).cuda()
    (r,) = kspec.call("mhc.sinkhorn.fwd", logits, t_max=t_max, eps_sk=eps)
    want = ref.sinkhorn_fwd(to_np(logits), t_max, eps)
    assert t.isfinite(r).all() and max_rel(r, want) <= 1e-5
    if eps == 0:
        np.testing.assert_allclose(to_np(r).sum(axis=1), 1.0, atol=1e-5)
    dR = t.randn(33, n, n).cuda()
    (dz,) = kspec.call("mhc.sinkhorn.bwd", logits, dR, t_max=t_max, eps_sk=eps)
    assert t.isfinite(dz).all() and max_rel(dz, ref.sinkhorn_bwd(to_np(logits), to_np(dR), t_max, eps)) <= 1e-4


@pytest.mark.gpu
def test_pre_backward_is_bitwise_deterministic():
    t = torch_or_skip()
    B, S, n, D = 1, 1031, 4, 4000
    x, phi, alpha, bias, gam = mhc_layer_inputs(B, S, n, D, t.bfloat16, seed=3)
    _, _, _, _, inv, h = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam)
    dy = t.randn(B, S, D).bfloat16().cuda()
    dh_post, dr = t.randn(B, S, n).cuda(), t.randn(B, S, n, n).cuda()
    runs = [kspec.call("mhc.pre.bwd", dy, x, phi, alpha, bias, gam, inv, h, None, dh_post, dr, None) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert t.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(1, 64), (3, 33), (4, 4000), (8, 128)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_post_pre_matches_post_then_pre(n, D, dtype_name):
    """kspec.ops.mhc_post_pre against kspec.ops.mhc_post then mhc_pre on [B, S, n, D]: outputs and every
    gradient (x_next's own and y's), within the dtype's tolerance; then a HyperConnectionStack of three
    layers against the layers in turn."""
    t = torch_or_skip()
    dtype = getattr(t, dtype_name)
    B, S = 2, 3
    x, phi, alpha, bias, gam = mhc_layer_inputs(B, S, n, D, dtype, seed=n * 100 + D)
    g = t.Generator(device="cuda").manual_seed(D)
    f = t.randn(B, S, D, device="cuda", generator=g).to(dtype)
    h_post = 2 * t.sigmoid(t.randn(B, S, n, device="cuda", generator=g))
    h_res = t.softmax(t.randn(B, S, n, n, device="cuda", generator=g), dim=-2)
    dxn, dy = t.randn_like(x), t.randn_like(f)

    def grads(fn):
        leaves = [a.detach().clone().requires_grad_() for a in (x, f, h_post, h_res, phi, alpha, bias, gam)]
        x_next, y = fn(*leaves)[:2]
        t.autograd.backward([x_next, y], [dxn, dy])
        return [x_next.detach(), y.detach()] + [a.grad for a in leaves]

    fused = grads(kspec.ops.mhc_post_pre)

    def unfused(x, f, h_post, h_res, phi, alpha, bias, gam):
        x_next = kspec.ops.mhc_post(x, f, h_post, h_res)
        return (x_next,) + kspec.ops.mhc_pre(x_next, phi, alpha, bias, gam)

    names = ["x_next", "y", "dx", "df", "dh_post", "dh_res", "dphi", "dalpha", "dbias", "dgamma"]
    for name, a, b in zip(names, fused, grads(unfused)):
        assert max_rel(a, to_np(b)) <= _tol(dtype, name.startswith("d")), name

    layers = [kspec.nn.HyperConnection(D, n, t.nn.Linear(D, D, device="cuda", dtype=dtype), device="cuda")
              for _ in range(3)]
    with t.no_grad():
        for hc in layers:
            hc.phi.normal_(0, (n * D) ** -0.5, generator=g)
    stack = kspec.nn.HyperConnectionStack(layers)
    out = stack(x)
    want = x
    for hc in layers:
        want = hc(want)
    assert max_rel(out, to_np(want)) <= _tol(dtype, False)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma,with_dx_post", [(True, True), (False, False)])
def test_pre_backward_ahead_algos_give_the_warp_heads_bits(gamma, with_dx_post):
    """mhc.pre.bwd algo=mma_fused_ahead (the fused kernel's per-token coefficients a step ahead, 8-byte dx stores,
    parts from the last) and algo=mma_fused_phi_ring (that with the token pass's phi through a cp.async ring) at 32
    and 16 tokens: the bits of algo=mma_fused_warp_heads, and the float64 reference."""
    t = torch_or_skip()
    B, S, n, D = 1, 1031, 4, 4000
    x, phi, alpha, bias, gam = mhc_layer_inputs(B, S, n, D, t.bfloat16, seed=7, gamma=gamma)
    _, _, _, _, inv, h = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam)
    dy = t.randn(B, S, D).bfloat16().cuda()
    dh_post, dr = t.randn(B, S, n).cuda(), t.randn(B, S, n, n).cuda()
    dx_post = t.randn(B, S, n, D).bfloat16().cuda() if with_dx_post else None

    def bwd(config):
        return kspec.call("mhc.pre.bwd", dy, x, phi, alpha, bias, gam, inv, h, None, dh_post, dr, dx_post,
                          config=config)

    base = bwd("algo=4,threads=128,tokens=32")
    for algo in (6, 7):
        for tokens in (32, 16):
            for a, b in zip(base, bwd(f"algo={algo},threads=128,tokens={tokens}")):
                if a is not None:
                    assert t.equal(a, b), (algo, tokens)
    T = B * S
    g = ref.mhc_pre_bwd(to_np(dy).reshape(T, D), to_np(x).reshape(T, n, D), to_np(phi), to_np(alpha), to_np(bias),
                        to_np(gam) if gamma else None, dh_post=to_np(dh_post).reshape(T, n),
                        dr=to_np(dr).reshape(T, n, n),
                        dx_post=to_np(dx_post).reshape(T, n, D) if with_dx_post else None)
    for name, got in zip(("dx", "dphi", "dalpha", "dbias", "dgamma"), base):
        if got is not None and g.get(name) is not None:
            assert max_rel(got.reshape(g[name].shape), g[name]) <= _tol(t.float32 if name != "dx" else t.bfloat16,
                                                                        True), name
