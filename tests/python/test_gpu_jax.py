"""kspec.jax on the GPU: every function's forward and jax.grad of a random projection against the float64
references (fp32/bf16/fp16; both scan layouts; T=1, T=2, odd lengths), a jitted call run twice gives the
same bits, and the same numbers as kspec's torch path on the same inputs (bitwise for the forwards; torch
comparisons skip without torch)."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch in this process

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import rel_err  # noqa: E402

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kspec  # noqa: E402
from kspec import _xla  # noqa: E402
from kspec.reference import adamw as adamw_ref  # noqa: E402
from kspec.reference import e79 as e79_ref  # noqa: E402
from kspec.reference import norm_act as norm_ref  # noqa: E402
from kspec.reference import selective_scan as scan_ref  # noqa: E402


def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _xla.available(), reason="kspec built without XLA FFI"),
              pytest.mark.skipif(not _jax_gpu(), reason="no CUDA device for jax")]

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
TORCH_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


@pytest.fixture(scope="module")
def kj():
    import kspec.jax as kj

    return kj


def _tol(op, dt):
    return kspec.op_info(op)["tolerances"][TORCH_NAMES[dt]]


def _f64(x):
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _to_torch(torch, x):
    return None if x is None else torch.from_dlpack(jax.block_until_ready(x))


def _check(errs, tol):
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"


# ---- selective scan ----

SCAN_SHAPES = {"base": (2, 24, 300, 16), "T1": (2, 8, 1, 16), "T2": (1, 8, 2, 4), "odd": (2, 37, 129, 8)}


def _scan_inputs(b, d, L, n, dt, seed=0):
    rng = np.random.default_rng(seed)
    rn = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = dict(u=rn(b, d, L), delta=rn(b, d, L), A=-(0.25 + np.abs(rn(d, n))), B=rn(b, n, L), C=rn(b, n, L),
             D=rn(d), z=rn(b, d, L), delta_bias=rn(d), h0=rn(b, d, n))
    j = {k: jnp.asarray(v, DTYPES[dt] if k in ("u", "delta", "B", "C", "z") else jnp.float32) for k, v in x.items()}
    return j


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", list(SCAN_SHAPES))
@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_selective_scan_forward_and_grad(kj, dt, shape, layout):
    b, d, L, n = SCAN_SHAPES[shape]
    x = _scan_inputs(b, d, L, n, dt)
    rng = np.random.default_rng(1)
    P = rng.standard_normal((b, d, L))
    Q = rng.standard_normal((b, d, n))
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")
    tr = (lambda a: jnp.swapaxes(a, 1, 2)) if layout == "bld" else (lambda a: a)
    seq = {"u", "delta", "B", "C", "z"}

    def f(*args):
        a = dict(zip(names, args))
        out, last = kj.selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"],
                                      delta_softplus=True, h0=a["h0"], layout=layout, return_last_state=True,
                                      bld_mode="in_place")  # the handlers' bld path (the default)
        return out, last

    args = [tr(x[k]) if k in seq else x[k] for k in names]

    def loss(*args):
        out, last = f(*args)
        return jnp.sum(tr(out).astype(jnp.float32) * P) + jnp.sum(last * Q)

    out, last = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(*args)
    np_in = {k: _f64(x[k]) for k in names}
    kw = {k: np_in[k] for k in ("D", "z", "delta_bias", "h0")}
    out_r, last_r = scan_ref.selective_scan_fwd(np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                                delta_softplus=True, **kw)
    g_r = scan_ref.selective_scan_bwd(P, np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                      delta_softplus=True, dlast_state=Q, **kw)
    errs = {"out": rel_err(_f64(tr(out)), out_r), "last_state": rel_err(_f64(last), last_r)}
    for k, g in zip(names, grads):
        assert g.shape == dict(zip(names, args))[k].shape and g.dtype == dict(zip(names, args))[k].dtype, k
        errs["d" + k] = rel_err(_f64(tr(g) if k in seq else g), g_r["d" + k])
    _check(errs, _tol("selective_scan.fwd", dt))

    # jit twice: the same bits
    out2, _ = jax.jit(f)(*args)
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))

    torch = _torch()
    if torch is not None:  # the torch path on the same inputs: the same forward kernel, the same bits
        t = {k: _to_torch(torch, x[k]) for k in names}
        if layout == "bdl":
            t_out, t_last = kspec.ops.selective_scan_fn(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                                        t["delta_bias"], True, True, t["h0"])
        else:
            # bld runs the op's time-major kernels (algo=sequential, one segment), which ops.selective_scan_fn
            # (bdl, the warp kernels at these shapes) does not: kspec.call with layout="bld" on [b, L, d]
            # memory viewed as [b, d, L] (B/C [b, L, 1, n] as [b, 1, n, L]) runs the same kernel.
            seq_view = lambda a: a.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
            bc_view = lambda a: a.transpose(1, 2).contiguous().unsqueeze(2).permute(0, 2, 3, 1)  # noqa: E731
            t_out = seq_view(torch.empty_like(t["u"]))
            t_last = torch.empty((b, d, n), dtype=torch.float32, device=t["u"].device)
            kspec.call("selective_scan.fwd", seq_view(t["u"]), seq_view(t["delta"]), t["A"], bc_view(t["B"]),
                       bc_view(t["C"]), t["D"], seq_view(t["z"]), t["delta_bias"], t["h0"], out=(t_out, t_last, None),
                       delta_softplus=True, layout="bld")
        assert torch.equal(_to_torch(torch, tr(out)).float(), t_out.float())
        assert torch.equal(_to_torch(torch, last), t_last)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_selective_scan_grouped_bc_forward_and_grad(kj, dt, layout):
    """B and C in 2 groups (4-D: bdl (batch, groups, dstate, seqlen), bld (batch, seqlen, groups, dstate),
    the bld buffers read where they lie): forward and every gradient against the float64 reference."""
    b, d, L, n, g = 2, 64, 70, 8, 2
    rng = np.random.default_rng(3)
    rn = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = dict(u=rn(b, d, L), delta=rn(b, d, L), A=-(0.25 + np.abs(rn(d, n))), B=rn(b, g, n, L), C=rn(b, g, n, L),
             D=rn(d), z=rn(b, d, L))
    names = ("u", "delta", "A", "B", "C", "D", "z")
    j = {k: jnp.asarray(v, DTYPES[dt] if k in ("u", "delta", "B", "C", "z") else jnp.float32) for k, v in x.items()}
    seq = lambda a: jnp.swapaxes(a, 1, 2) if layout == "bld" else a  # noqa: E731  [b, d, L] <-> [b, L, d]
    bc = lambda a: jnp.transpose(a, (0, 3, 1, 2)) if layout == "bld" else a  # noqa: E731  [b, g, n, L] -> [b, L, g, n]
    bc_back = lambda a: jnp.transpose(a, (0, 2, 3, 1)) if layout == "bld" else a  # noqa: E731
    args = [seq(j[k]) if k in ("u", "delta", "z") else bc(j[k]) if k in ("B", "C") else j[k] for k in names]
    P = rng.standard_normal((b, d, L))

    def f(*a):
        return kj.selective_scan(*a, delta_softplus=True, layout=layout, bld_mode="in_place")

    out = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(seq(f(*a)).astype(jnp.float32) * P), argnums=tuple(range(7))))(*args)
    np_in = {k: _f64(j[k]) for k in names}
    out_r, _ = scan_ref.selective_scan_fwd(np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                           D=np_in["D"], z=np_in["z"], delta_softplus=True)
    g_r = scan_ref.selective_scan_bwd(P, np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"], D=np_in["D"],
                                      z=np_in["z"], delta_softplus=True)
    back = {"u": seq, "delta": seq, "z": seq, "B": bc_back, "C": bc_back}
    errs = {"out": rel_err(_f64(seq(out)), out_r)}
    for k, gk in zip(names, grads):
        errs["d" + k] = rel_err(_f64(back.get(k, lambda a: a)(gk)), g_r["d" + k])
    _check(errs, _tol("selective_scan.fwd", dt))


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("groups", [None, 2])
def test_selective_scan_bld_transpose_is_bdl(kj, dt, groups):
    """bld_mode="transpose" runs the bdl kernels on XLA's transposes of the bld operands: out and last_state
    are bdl's bit for bit, in bld's order, and every gradient is bdl's (within the tolerance: the backward's
    cross-channel sums may add in another order)."""
    b, d, L, n = 2, 64, 70, 8
    rng = np.random.default_rng(5)
    rn = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    bc_shape = (b, n, L) if groups is None else (b, groups, n, L)
    x = dict(u=rn(b, d, L), delta=rn(b, d, L), A=-(0.25 + np.abs(rn(d, n))), B=rn(*bc_shape), C=rn(*bc_shape),
             D=rn(d), z=rn(b, d, L), delta_bias=rn(d), h0=rn(b, d, n))
    names = tuple(x)
    j = {k: jnp.asarray(v, DTYPES[dt] if k in ("u", "delta", "B", "C", "z") else jnp.float32) for k, v in x.items()}
    seq = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  [b, d, L] <-> [b, L, d]
    bc = lambda a: jnp.swapaxes(a, 1, 2) if a.ndim == 3 else jnp.transpose(a, (0, 3, 1, 2))  # noqa: E731
    bc_back = lambda a: jnp.swapaxes(a, 1, 2) if a.ndim == 3 else jnp.transpose(a, (0, 2, 3, 1))  # noqa: E731
    to_bld = {"u": seq, "delta": seq, "z": seq, "B": bc, "C": bc}
    back = {"u": seq, "delta": seq, "z": seq, "B": bc_back, "C": bc_back}
    P = jnp.asarray(rn(b, d, L), j["u"].dtype)
    Q = jnp.asarray(rn(b, d, n))

    def run(layout, **kw):
        def f(*a):
            a = dict(zip(names, a))
            return kj.selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"],
                                     delta_softplus=True, h0=a["h0"], layout=layout, return_last_state=True, **kw)

        args = [to_bld[k](j[k]) if layout == "bld" and k in to_bld else j[k] for k in names]
        (out, last), vjp = jax.vjp(jax.jit(f), *args)
        grads = vjp((seq(P) if layout == "bld" else P, Q))
        return out, last, grads

    out_d, last_d, g_d = run("bdl")
    out_t, last_t, g_t = run("bld", bld_mode="transpose")
    assert out_t.shape == (b, L, d)
    assert np.array_equal(np.asarray(seq(out_t), np.float32), np.asarray(out_d, np.float32))
    assert np.array_equal(np.asarray(last_t), np.asarray(last_d))
    errs = {}
    for k, gt, gd in zip(names, g_t, g_d):
        gt = back[k](gt) if k in back else gt
        assert gt.shape == gd.shape and gt.dtype == gd.dtype, k
        errs["d" + k] = rel_err(_f64(gt), _f64(gd))
    _check(errs, _tol("selective_scan.fwd", dt))


@pytest.mark.parametrize("dt", list(DTYPES))
def test_selective_scan_step_matches_reference(kj, dt):
    b, d, n = 2, 24, 16
    x = _scan_inputs(b, d, 1, n, dt)
    state = x["h0"]
    u, delta, z = (x[k][..., 0] for k in ("u", "delta", "z"))
    B, C = x["B"][..., 0], x["C"][..., 0]
    out, new_state = jax.jit(lambda *a: kj.selective_scan_step(*a, D=x["D"], z=z, delta_bias=x["delta_bias"],
                                                               delta_softplus=True))(state, u, delta, x["A"], B, C)
    np_in = {k: _f64(x[k]) for k in x}
    out_r, last_r = scan_ref.selective_scan_fwd(np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                                D=np_in["D"], z=np_in["z"], delta_bias=np_in["delta_bias"],
                                                delta_softplus=True, h0=np_in["h0"])
    _check({"out": rel_err(_f64(out), out_r[..., 0]), "new_state": rel_err(_f64(new_state), last_r)},
           _tol("selective_scan.step", dt))


# ---- norm_act ----

@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("norm,act,hidden,bias", [("layernorm", "gelu_tanh", 1000, True), ("rmsnorm", "silu", 4096, False),
                                                  ("layernorm", "identity", 37, True)])
def test_norm_act_forward_and_grad(kj, dt, norm, act, hidden, bias):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, hidden)), DTYPES[dt])
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.float32)
    bb = jnp.asarray(0.1 * rng.standard_normal(hidden), jnp.float32) if bias else None
    P = rng.standard_normal((3, 5, hidden))

    def f(x, w, bb):
        return kj.norm_act(x, w, bb, norm=norm, act=act, eps=1e-5)

    y = jax.jit(f)(x, w, bb)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * P), argnums=(0, 1, 2) if bias else (0, 1)))(
        x, w, bb)
    y_r, _, _ = norm_ref.norm_act_fwd(_f64(x), _f64(w), _f64(bb), norm, act, 1e-5)
    dx_r, dw_r, db_r = norm_ref.norm_act_bwd(P, _f64(x), _f64(w), _f64(bb), norm, act, 1e-5)
    errs = {"y": rel_err(_f64(y), y_r), "dx": rel_err(_f64(grads[0]), dx_r), "dw": rel_err(_f64(grads[1]), dw_r)}
    if bias:
        errs["db"] = rel_err(_f64(grads[2]), db_r)
    _check(errs, _tol("norm_act.fwd", dt))
    assert np.array_equal(np.asarray(y, np.float32), np.asarray(jax.jit(f)(x, w, bb), np.float32))
    torch = _torch()
    if torch is not None:
        t_y = kspec.ops.norm_act(_to_torch(torch, x), _to_torch(torch, w), _to_torch(torch, bb), norm=norm, act=act)
        assert torch.equal(_to_torch(torch, y), t_y)


# ---- e79 ----

@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("T,bias", [(1, "fixed"), (2, "none"), (37, "fixed"), (33, "input")])
def test_e79_cell_forward_and_grad(kj, dt, T, bias):
    B, n, chunk = 2, 16, 8
    rng = np.random.default_rng(0)
    cols = 6 if bias == "input" else 4
    kvqm = jnp.asarray(0.5 * rng.standard_normal((T, B, cols * n)), DTYPES[dt])
    bs = jnp.asarray(0.1 * rng.standard_normal(n), jnp.float32) if bias == "fixed" else None
    bm = jnp.asarray(0.1 * rng.standard_normal(n), jnp.float32) if bias == "fixed" else None
    S0 = jnp.asarray(0.1 * rng.standard_normal((B, n, n)), jnp.float32)
    M0 = jnp.asarray(0.1 * rng.standard_normal((B, n, n)), jnp.float32)
    P, PS, PM = rng.standard_normal((T, B, n)), rng.standard_normal((B, n, n)), rng.standard_normal((B, n, n))

    def f(kvqm, bs, bm, S0, M0):
        return kj.e79_cell(kvqm, n, bs, bm, S0, M0, bias=bias, chunk=chunk)

    def loss(*a):
        out, S, M = f(*a)
        return jnp.sum(out.astype(jnp.float32) * P) + jnp.sum(S * PS) + jnp.sum(M * PM)

    out, S, M = jax.jit(f)(kvqm, bs, bm, S0, M0)
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(kvqm, bs, bm, S0, M0)
    blocks = [_f64(kvqm)[..., j * n:(j + 1) * n] for j in range(cols)]
    b_s, b_m = (blocks[4], blocks[5]) if bias == "input" else (_f64(bs), _f64(bm))
    out_r, S_r, M_r = e79_ref.e79_fwd(*blocks[:4], b_s, b_m, _f64(S0), _f64(M0))
    gr = e79_ref.e79_bwd(P, *blocks[:4], b_s, b_m, _f64(S0), _f64(M0), dS=PS, dM=PM)
    dkvqm_r = np.concatenate([gr["dk"], gr["dv"], gr["dq"], gr["dm"]] + ([gr["db_s"], gr["db_m"]] if bias == "input" else []),
                             axis=-1)
    errs = {"out": rel_err(_f64(out), out_r), "S": rel_err(_f64(S), S_r), "M": rel_err(_f64(M), M_r),
            "dkvqm": rel_err(_f64(g[0]), dkvqm_r), "dS0": rel_err(_f64(g[3]), gr["dS0"]),
            "dM0": rel_err(_f64(g[4]), gr["dM0"])}
    if bias == "fixed":
        errs["db_s"] = rel_err(_f64(g[1]), gr["db_s"])
        errs["db_m"] = rel_err(_f64(g[2]), gr["db_m"])
    _check(errs, _tol("e79.fwd", dt))
    out2 = jax.jit(f)(kvqm, bs, bm, S0, M0)[0]
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))
    torch = _torch()
    if torch is not None:
        t_out, t_S, _ = kspec.ops.e79_cell(_to_torch(torch, kvqm), n, _to_torch(torch, bs), _to_torch(torch, bm),
                                           _to_torch(torch, S0), _to_torch(torch, M0), bias=bias, chunk=chunk)
        assert torch.equal(_to_torch(torch, out), t_out) and torch.equal(_to_torch(torch, S), t_S)


# ---- AdamW ----

@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_steps_match_reference(kj, dt, amsgrad):
    rng = np.random.default_rng(0)
    shapes = {"w": (7, 33), "b": (33,), "e": (1000,)}
    params = {k: jnp.asarray(rng.standard_normal(s), DTYPES[dt]) for k, s in shapes.items()}
    state = kj.adamw_init(params, amsgrad=amsgrad)
    hyper = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, max_norm=1.0)
    step = jax.jit(lambda p, g, s, lr: kj.adamw_step(p, g, s, lr=lr, **hyper), donate_argnums=(0, 2))
    names = sorted(shapes)
    ref_p = [_f64(params[k]) for k in names]
    ref_m = [np.zeros(shapes[k]) for k in names]
    ref_v = [np.zeros(shapes[k]) for k in names]
    ref_vmax = [np.zeros(shapes[k]) for k in names] if amsgrad else None
    for it, lr in enumerate([1e-2, 5e-3, 2e-3]):  # a schedule: lr and the step change without recompiling
        grads = {k: jnp.asarray(rng.standard_normal(s), DTYPES[dt]) for k, s in shapes.items()}
        params, state, norm = step(params, grads, state, jnp.float32(lr))
        _, norm_r = adamw_ref.adamw_step(ref_p, [_f64(grads[k]) for k in names], ref_m, ref_v, ref_vmax, lr=lr,
                                         step=it + 1, **hyper)
        assert int(state.step) == it + 1
        assert abs(float(norm[0]) - norm_r) <= 1e-4 * norm_r
    got = state.master if dt != "f32" else params
    errs = {k: rel_err(_f64(got[k]), ref_p[i]) for i, k in enumerate(names)}
    errs.update({"m_" + k: rel_err(_f64(state.exp_avg[k]), ref_m[i]) for i, k in enumerate(names)})
    _check(errs, 1e-5)
    assert step._cache_size() == 1


def test_adamw_step_outside_jit_donated_updates_in_place(kj):
    """adamw_step called outside jit with donate=True: the new params and moments live in the buffers
    passed in (the inputs are deleted), and the numbers are those of the default (copying) call."""
    rng = np.random.default_rng(5)
    shapes = {"w": (7, 33), "b": (33,)}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    g = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
    params = {k: jnp.asarray(v) for k, v in p0.items()}
    state = kj.adamw_init(params)
    ref_p, ref_s, _ = kj.adamw_step(params, g, state, **hyper)
    assert not params["w"].is_deleted()  # the default call copies: the caller's arrays stay valid
    ptrs = {k: params[k].unsafe_buffer_pointer() for k in shapes}
    m_ptrs = {k: state.exp_avg[k].unsafe_buffer_pointer() for k in shapes}
    new_p, new_s, _ = kj.adamw_step(params, g, state, donate=True, **hyper)
    assert params["w"].is_deleted() and state.exp_avg["w"].is_deleted()
    assert {k: new_p[k].unsafe_buffer_pointer() for k in shapes} == ptrs
    assert {k: new_s.exp_avg[k].unsafe_buffer_pointer() for k in shapes} == m_ptrs
    for k in shapes:
        assert np.array_equal(np.asarray(new_p[k]), np.asarray(ref_p[k]))
        assert np.array_equal(np.asarray(new_s.exp_avg_sq[k]), np.asarray(ref_s.exp_avg_sq[k]))
    assert int(new_s.step) == 1


@pytest.mark.parametrize("schedule", [False, True])
def test_adamw_transformation_matches_optax(kj, schedule):
    """kspec.jax.adamw in optax's place (optax.chain, apply_updates) steps like optax.adamw, fp32."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((7, 33)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((33,)), jnp.float32)}
    lr = optax.linear_schedule(1e-2, 1e-3, 3) if schedule else 1e-2
    ours = optax.chain(kj.adamw(lr, b1=0.9, b2=0.99, weight_decay=0.1))
    theirs = optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=0.1)
    p_k, p_o = params, params
    s_k, s_o = ours.init(p_k), theirs.init(p_o)
    step_k = jax.jit(lambda g, s, p: ours.update(g, s, p))
    for _ in range(3):
        grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in params.items()}
        u_k, s_k = step_k(grads, s_k, p_k)
        u_o, s_o = theirs.update(grads, s_o, p_o)
        p_k, p_o = optax.apply_updates(p_k, u_k), optax.apply_updates(p_o, u_o)
    _check({k: rel_err(_f64(p_k[k]), _f64(p_o[k])) for k in params}, 1e-5)


def _adamw_lr_schedule():
    return [1e-2, 5e-3, 2e-3, 1e-3, 3e-3]  # lr changes every step: an operand, never a recompilation


def test_adamw_step_matches_torch_and_optax_fp32(kj):
    """fp32, five steps with a new lr each: kspec.jax.adamw_step (donated, so the handler's bound call is
    reused) against torch.optim.AdamW and optax.adamw within 1e-6; one compilation for all steps."""
    rng = np.random.default_rng(2)
    shapes = {"w": (7, 33), "b": (33,), "e": (1000,)}
    names = sorted(shapes)
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in _adamw_lr_schedule()]
    hyper = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    step = jax.jit(lambda p, g, s, lr: kj.adamw_step(p, g, s, lr=lr, **hyper), donate_argnums=(0, 2))
    params = {k: jnp.asarray(v) for k, v in p0.items()}
    state = kj.adamw_init(params)
    for lr, g in zip(_adamw_lr_schedule(), grads):
        params, state, _ = step(params, {k: jnp.asarray(v) for k, v in g.items()}, state, jnp.float32(lr))
    assert step._cache_size() == 1
    got = {k: _f64(params[k]) for k in names}
    checked = 0
    torch = _torch()
    if torch is not None:
        tp = [torch.tensor(p0[k], device="cuda", requires_grad=True) for k in names]
        opt = torch.optim.AdamW(tp, lr=1e-2, betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                                weight_decay=hyper["weight_decay"])
        for lr, g in zip(_adamw_lr_schedule(), grads):
            for group in opt.param_groups:
                group["lr"] = lr
            for t, k in zip(tp, names):
                t.grad = torch.tensor(g[k], device="cuda")
            opt.step()
        _check({k: rel_err(got[k], t.detach().double().cpu().numpy()) for k, t in zip(names, tp)}, 1e-6)
        checked += 1
    try:
        import optax
    except ImportError:
        optax = None
    if optax is not None:
        lrs = jnp.asarray(_adamw_lr_schedule(), jnp.float32)
        tx = optax.adamw(lambda count: lrs[count], b1=hyper["beta1"], b2=hyper["beta2"], eps=hyper["eps"],
                         weight_decay=hyper["weight_decay"])
        po = {k: jnp.asarray(v) for k, v in p0.items()}
        so = tx.init(po)
        for g in grads:
            u, so = tx.update({k: jnp.asarray(v) for k, v in g.items()}, so, po)
            po = optax.apply_updates(po, u)
        _check({k: rel_err(got[k], _f64(po[k])) for k in names}, 1e-6)
        checked += 1
    if not checked:
        pytest.skip("neither torch (CUDA) nor optax to compare with")


def test_adamw_step_with_moving_buffers_matches_donated(kj):
    """New gradients every step, params and state donated or not: the handler runs a bound call kept for
    the buffers' addresses, binds a new one, or (past its limit) calls kspec::call; every path runs the
    same kernels, so both runs end with the same bits."""
    rng = np.random.default_rng(3)
    shapes = {"w": (5, 17), "b": (17,)}
    p0 = {k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for k, s in shapes.items()} for _ in range(20)]
    f = lambda p, g, s, lr: kj.adamw_step(p, g, s, lr=lr, weight_decay=0.1, max_norm=1.0)  # noqa: E731
    runs = {}
    for donate in (True, False):
        step = jax.jit(f, donate_argnums=(0, 2) if donate else ())
        params = jax.tree_util.tree_map(jnp.copy, p0)
        state = kj.adamw_init(params)
        for i, g in enumerate(grads):  # 20 steps: past the handler's 16 bound calls
            params, state, norm = step(params, g, state, jnp.float32(1e-3 * (1 + i % 3)))
        runs[donate] = (params, state.master, norm)
    for a, b in zip(jax.tree_util.tree_leaves(runs[True]), jax.tree_util.tree_leaves(runs[False])):
        assert np.array_equal(np.asarray(a), np.asarray(b))
