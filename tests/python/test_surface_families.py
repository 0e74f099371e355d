"""The torch surface of mlstm (issue 29), mhc (issue 34) and difflogic (issue 30) without a GPU.

Each family's fakes against C++ infer_outputs on every case of its ops (CUDA fake tensors; the custom op's
arguments found by name among the op's inputs); symbolic sizes kept under make_fx. Then the float64
references stand in for the kernels on CPU (a kspec.call that runs kspec.reference): opcheck on the
generated ops, and the eager path, the custom op's autograd and torch.compile(fullgraph=True) give the
reference's outputs and gradients; errors name the argument. The GPU twin: test_gpu_surface_families.py."""
import numpy as np
import pytest

from helpers import case_inputs, inferred_outputs

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _C, _difflogic, _mhc, _mlstm, _schema, _surface  # noqa: E402
from kspec.reference import difflogic as dl_ref  # noqa: E402
from kspec.reference import mhc as mhc_ref  # noqa: E402
from kspec.reference import mlstm as mlstm_ref  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

FAMILIES = ["mlstm_chunkwise", "mlstm_parallel", "mhc_pre", "mhc_pre_only", "mhc_post", "mhc_sinkhorn",
            "logic_layer", "mhc_post_pre"]
# A custom op's argument that is the op's input of another name.
ALIAS = {("logic_layer", "dy"): "dout"}
# Non-tensor arguments that are no param of the op: the value the fake test passes.
FLAGS = {"return_last_states": True, "save_rows": True, "mode": "soft", "grad_factor": 1.0}


def _derived(op, dims):
    """The dims mhc derives from n and D (M, nD, A), which its cases leave out."""
    if op.startswith(("mhc.pre", "mhc.post_pre")) and "n" in dims:
        n, po = dims["n"], op.startswith("mhc.pre_only")
        dims = {**dims, "M": n if po else n * n + 2 * n, "nD": n * dims["D"], "A": 1 if po else 3}
    return dims


def _custom_args(s, which, op, case):
    """The custom op's arguments for an op's case: tensors by name (fake, on CUDA), params from the case or
    the op's defaults. None when the case leaves a dim out."""
    info = _C.op_info(op)
    got = case_inputs(info, {**case, "dims": _derived(op, case["dims"])})
    if got is None:
        return None, None
    by_name = {d["name"]: (None if sh is None else torch.empty(sh, dtype=getattr(torch, dt), device="cuda"))
               for d, sh, dt in zip(info["inputs"], *got)}
    defaults = {p["name"]: p["default"] for p in info["params"]}
    args = []
    for name, typ in (s.fwd_args if which == "fwd" else s.bwd_args):
        key = ALIAS.get((s.family.name, name), name)
        if _surface._is_tensor(typ):
            if key in by_name:
                args.append(by_name[key])
            elif key == "consumers":  # the forward passes the wiring's CSR through for its backward
                args.append(torch.empty(3, dtype=torch.int32, device="cuda"))
            else:
                args.append(None)  # an upstream gradient the backward may go without
        else:
            args.append(case["params"].get(name, FLAGS.get(name, defaults.get(name))))
    return args, [by_name[d["name"]] for d in info["inputs"]]


@pytest.mark.parametrize("name", FAMILIES)
def test_fakes_match_infer_outputs_on_every_case(name):
    """Forward and backward fakes: every output C++ allocates has its shape and dtype (matched by name:
    a custom op output `d<x>` is the op's output `d<x>`); the ones only the surface asks for (mlstm's nrm,
    m_rows and last states) have the schema's shapes."""
    s = _surface.FAMILIES[name]
    checked = 0
    for which, op, custom, outs in (("fwd", s.family.ops[0], s.fwd_op, s.family.fwd_out),
                                    ("bwd", s.family.ops[1], s.bwd_op, s.family.bwd_out)):
        info = _C.op_info(op)
        names = [d["name"] for d in info["outputs"]]
        for case in [c for c in info["cases"] if not c["large"]]:
            with FakeTensorMode():
                args, tensors = _custom_args(s, which, op, case)
                if args is None:
                    continue
                got = custom(*args)
                got = got if isinstance(got, tuple) else (got,)
            want = inferred_outputs(op, [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
                                         for t in tensors], case["params"])
            for o, oname in zip(got, outs):
                assert o.device.type == "cuda"
                w = want[names.index(oname)] if oname in names else None
                if w is not None:
                    assert (str(o.dtype).removeprefix("torch."), tuple(o.shape)) == w, (op, case["name"], oname)
                elif oname in ("nrm", "m_rows"):
                    assert tuple(o.shape) == tuple(args[0].shape[:3]) and o.dtype == torch.float32
                elif oname in ("C_last", "n_last", "m_last"):
                    B, NH, _, DK = args[0].shape
                    shape = {"C_last": (B, NH, DK, args[2].shape[-1]), "n_last": (B, NH, DK), "m_last": (B, NH, 1)}
                    assert tuple(o.shape) == shape[oname] and o.dtype == torch.float32, (op, case["name"], oname)
                else:
                    assert o.numel() == 0, (op, case["name"], oname)
            checked += 1
    assert checked >= 4, checked


def test_mlstm_fake_keeps_symbolic_sizes():
    from torch.fx.experimental.proxy_tensor import make_fx

    q, v, i = torch.empty(2, 3, 37, 16), torch.empty(2, 3, 37, 32), torch.empty(2, 3, 37)
    gm = make_fx(lambda q, v, i: torch.ops.kspec.mlstm_chunkwise_fwd(q, q, v, i, i, None, None, None, True, 1e-6, 64,
                                                                     True), tracing_mode="symbolic")(q, v, i)
    h, nrm, m_rows, C, n, m = [x for x in gm.graph.nodes if x.op == "call_function"][0].meta["val"]
    assert all(isinstance(d, torch.SymInt) for d in h.shape) and [int(d) for d in h.shape] == [2, 3, 37, 32]
    assert str(nrm.shape[2]) == str(h.shape[2]) and str(C.shape[3]) == str(h.shape[3]) and int(m.shape[2]) == 1


# ---- the float64 references standing in for the kernels, on CPU ----

def _np(t):
    return None if t is None else t.detach().double().numpy()


def _m0(m):
    return None if m is None else m.reshape(m.shape[:2])


def _reference(op, a, p):
    """The op's outputs in schema order (numpy float64, None where absent) from its inputs `a` (numpy)."""
    if op == "mlstm.chunkwise.fwd":
        h, nrm, m, (C, n, mm) = mlstm_ref.mlstm_chunkwise_fwd(*a[:7], _m0(a[7]), chunk=p["chunk"], eps=p["eps"]) \
            if a[5] is not None else mlstm_ref.mlstm_chunkwise_fwd(*a[:5], chunk=p["chunk"], eps=p["eps"])
        return h, nrm, m, C, n, mm[..., None]
    if op == "mlstm.chunkwise.bwd":
        q, k, v, i, f, C0, m0, _nrm, _m_rows, dh, dC_last = a
        n0 = None if C0 is None else np.zeros(C0.shape[:3])  # the op's backward needs no n0 (nrm is given)
        g = mlstm_ref.mlstm_chunkwise_bwd(dh, q, k, v, i, f, C0, n0, _m0(m0), dC_last, chunk=p["chunk"], eps=p["eps"])
        return g["dq"], g["dk"], g["dv"], g["di"], g["df"], g["dC0"]
    if op == "mlstm.step":
        q, k, v = (t[:, :, None] for t in a[:3])  # one step: S = 1 (i, f are (B, NH, 1) already)
        i, f, C, n, m = a[3:]
        h, _, _, (C2, n2, m2) = mlstm_ref.mlstm_recurrent_fwd(q, k, v, i, f, C, n, m[..., 0], eps=p["eps"])
        return h[:, :, 0], C2, n2, m2[..., None]
    if op == "mlstm.parallel.fwd":
        return mlstm_ref.mlstm_parallel_fwd(*a, eps=p["eps"])
    if op == "mlstm.parallel.bwd":
        g = mlstm_ref.mlstm_parallel_bwd(a[7], *a[:5], eps=p["eps"])
        return g["dq"], g["dk"], g["dv"], g["di"], g["df"]
    if op.startswith(("mhc.pre.", "mhc.pre_only.")):
        po = op.startswith("mhc.pre_only")
        kw = dict(pre_only=po, eps_rms=p["eps_rms"], eps_pre=p["eps_pre"])
        if not po:
            kw.update(eps_sk=p["eps_sk"], t_max=p["t_max"])
        if op.endswith(".fwd"):
            o = mhc_ref.mhc_pre_fwd(*a, **kw)
            return tuple(o[k] for k in (("y", "h_pre") if po else ("y", "h_pre", "h_post", "r")) + ("inv", "h"))
        dy, x, phi, alpha, bias, gamma, _inv, _h, dh_pre, *rest = a
        dh_post, dr, dx_post = rest if not po else (None, None, rest[0])
        g = mhc_ref.mhc_pre_bwd(dy, x, phi, alpha, bias, gamma, dh_pre, dh_post, dr, dx_post, **kw)
        return g["dx"], g["dphi"], g["dalpha"], g["dbias"], g["dgamma"]
    if op.startswith("mhc.post_pre."):
        kw = dict(eps_rms=p["eps_rms"], eps_pre=p["eps_pre"], eps_sk=p["eps_sk"], t_max=p["t_max"])
        if op.endswith(".fwd"):
            o = mhc_ref.mhc_post_pre_fwd(*a, **kw)
            return tuple(o[k] for k in ("x_next", "y", "h_pre", "h_post", "r", "inv", "h"))
        g = mhc_ref.mhc_post_pre_bwd(*a[:9], *a[10:14], **kw)  # x_next (a[9]), inv, h: recomputed
        return tuple(g[k] for k in ("dx", "df", "dh_post", "dr", "dphi", "dalpha", "dbias", "dgamma"))
    if op == "mhc.post.fwd":
        return (mhc_ref.mhc_post_fwd(*a),)
    if op == "mhc.post.bwd":
        g = mhc_ref.mhc_post_bwd(*a)
        return g["dx"], g["df"], g["dh_post"], g["dr"]
    if op == "mhc.sinkhorn.fwd":
        return (mhc_ref.sinkhorn_fwd(a[0], p["t_max"], p["eps_sk"]),)
    if op == "mhc.sinkhorn.bwd":
        return (mhc_ref.sinkhorn_bwd(a[0], a[1], p["t_max"], p["eps_sk"]),)
    if op == "difflogic.layer.fwd":
        x, logits, wa, wb = a
        return (dl_ref.layer_fwd(x, logits, wa.astype(np.int64), wb.astype(np.int64), hard=p["mode"] == "hard"),)
    if op == "difflogic.layer.bwd":
        x, logits, wa, wb, dout, _csr = a
        return dl_ref.layer_bwd(dout, x, logits, wa.astype(np.int64), wb.astype(np.int64), p["grad_factor"])
    if op == "difflogic.transpose":  # a row-major x to the feature-major layer kernels, and dx back
        return (a[0].T,)
    if op == "difflogic.group_sum.fwd":
        B, k, m = a[0].shape
        return (dl_ref.group_sum(a[0].reshape(B, k * m), k, p["tau"]),)
    if op == "difflogic.group_sum.bwd":  # dy expanded over each group
        return (a[0] / p["tau"],)
    raise AssertionError(op)


def _reference_call(op, *inputs, out=None, config=None, **params):
    """kspec.call on CPU tensors through the float64 reference: outputs of the schema's dtypes (or into out)."""
    info = _C.op_info(op)
    p = {d["name"]: d["default"] for d in info["params"]}
    p.update(params)
    a = [None if t is None else (t.numpy() if t.dtype == torch.int32 else _np(t)) for t in inputs]
    a += [None] * (len(info["inputs"]) - len(a))
    for j, d in enumerate(info["inputs"]):  # mhc's leading "...T" dims as one token dim (the references' T)
        if a[j] is not None and d["shape"] and d["shape"][0] == "...T":
            a[j] = a[j].reshape((-1,) + a[j].shape[a[j].ndim - len(d["shape"]) + 1:])
    res = _reference(op, a, p)
    specs = _schema.output_specs(op, [None if t is None else tuple(t.shape) for t in inputs],
                                 [None if t is None else str(t.dtype).removeprefix("torch.") for t in inputs],
                                 present={d["name"]: True for d in info["outputs"]})
    # an output present with a bool param (mhc.pre.fwd's inv and h with save_stats) is absent where it is off
    dropped = [p.get(d.get("present_with")) is False for d in info["outputs"]]
    got = []
    for j, r in enumerate(res):
        if r is None or (out is not None and out[j] is None) or dropped[j]:
            got.append(None)
            continue
        t = torch.from_numpy(np.ascontiguousarray(r)).to(getattr(torch, specs[j][0])).reshape(specs[j][1])
        if out is not None:
            out[j].copy_(t.reshape(out[j].shape))
            t = out[j]
        got.append(t)
    return tuple(got)


@pytest.fixture
def on_reference(monkeypatch):
    for mod in (_mlstm, _mhc, _difflogic, _surface):
        monkeypatch.setattr(mod, "call", _reference_call)
    # mhc's no-grad entries call the torch fast path straight: through `call` here (the reference)
    monkeypatch.setattr(_mhc, "_forward", lambda op, inputs, params: _mhc.call(op, *inputs, **params))
    for name in FAMILIES:
        s = _surface.FAMILIES[name]
        monkeypatch.setattr(s, "grad_call", None)  # call_grad's C++ node runs the kernels, not `call`
        s.fwd_op.register_kernel("cpu", s.fwd_kernel)
        s.bwd_op.register_kernel("cpu", s.bwd_kernel)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _mlstm_inputs(g, B=1, NH=2, S=37, DK=8, DV=16, states=False):
    q, k = torch.randn(B, NH, S, DK, generator=g, dtype=torch.float64), torch.randn(B, NH, S, DK, generator=g,
                                                                                    dtype=torch.float64)
    v = torch.randn(B, NH, S, DV, generator=g, dtype=torch.float64)
    i, f = torch.randn(B, NH, S, generator=g, dtype=torch.float64), 2 + torch.randn(B, NH, S, generator=g,
                                                                                    dtype=torch.float64)
    st = (torch.randn(B, NH, DK, DV, generator=g).float(), torch.randn(B, NH, DK, generator=g).float(),
          torch.randn(B, NH, 1, generator=g).float()) if states else (None, None, None)
    return (q, k, v, i, f), st


def _close(got, want, tol=1e-5):
    got = _np(got)
    assert got.shape == np.shape(want), (got.shape, np.shape(want))
    assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1.0)


def _grad(fn, leaves, seed_grads):
    """Outputs of fn(*leaves) and the gradients of sum(out * seed) for the outputs seeded."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, seed_grads) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return outs, grads


def _three_doors(public, custom, leaves, seeds):
    """(outs, grads) of the public entry eager, of the custom op, of torch.compile(fullgraph) of the entry."""
    compiled = torch.compile(public, backend="aot_eager", fullgraph=True, dynamic=False)
    return [_grad(fn, leaves, seeds) for fn in (public, custom, compiled)]


@pytest.mark.parametrize("states", [False, True])
def test_mlstm_chunkwise_doors_agree_with_reference(on_reference, states):
    g = _gen(1)
    (q, k, v, i, f), (C0, n0, m0) = _mlstm_inputs(g, states=states)
    dh, dC = torch.randn(v.shape, generator=g, dtype=torch.float64), torch.randn(1, 2, 8, 16, generator=g)
    x = [_np(t) for t in (q, k, v, i, f)]
    st = [_np(C0), _np(n0), None if m0 is None else _np(m0)[..., 0]]
    h, _, _, (C, n, m) = mlstm_ref.mlstm_chunkwise_fwd(*x, *st, chunk=16)
    want = mlstm_ref.mlstm_chunkwise_bwd(_np(dh), *x, st[0], None if C0 is None else np.zeros((1, 2, 8)), st[2],
                                         _np(dC), chunk=16)

    def public(q, k, v, i, f):
        h, (C, n, m) = kspec.ops.mlstm_chunkwise(q, k, v, i, f, C0, n0, m0, return_last_states=True, chunk_size=16)
        return h, C, n, m

    def custom(q, k, v, i, f):
        h, _, _, C, n, m = torch.ops.kspec.mlstm_chunkwise_fwd(q, k, v, i, f, C0, n0, m0, True, 1e-6, 16, True)
        return h, C, n, m

    for outs, grads in _three_doors(public, custom, (q, k, v, i, f), (dh, dC, None, None)):
        for got, ref in zip(outs, (h, C, n, m[..., None])):
            _close(got, ref)
        for got, name in zip(grads, ("dq", "dk", "dv", "di", "df")):
            _close(got, want[name])


def test_mlstm_chunkwise_dc_initial_and_parallel(on_reference):
    """dc_initial is C0's gradient (n0, m0: none); mlstm_parallel and kspec.ops.mlstm(kernel=...) route to
    the parallel op."""
    g = _gen(2)
    (q, k, v, i, f), (C0, n0, m0) = _mlstm_inputs(g, states=True)
    C0 = C0.double().requires_grad_()
    dh = torch.randn(v.shape, generator=g, dtype=torch.float64)
    h = kspec.ops.mlstm(q, k, v, i, f, C0, n0, m0, chunk_size=16)
    (dC0,) = torch.autograd.grad(h, C0, dh)
    x = [_np(t) for t in (q, k, v, i, f)]
    want = mlstm_ref.mlstm_chunkwise_bwd(_np(dh), *x, _np(C0), np.zeros((1, 2, 8)), _np(m0)[..., 0], chunk=16)
    _close(dC0, want["dC0"])
    hp, _, _ = mlstm_ref.mlstm_parallel_fwd(*x)
    gp = mlstm_ref.mlstm_parallel_bwd(_np(dh), *x)
    for fn in (lambda *a: kspec.ops.mlstm_parallel(*a), lambda *a: kspec.ops.mlstm(*a, kernel="parallel")):
        outs, grads = _grad(fn, (q, k, v, i, f), (dh,))
        _close(outs[0], hp)
        for got, name in zip(grads, ("dq", "dk", "dv", "di", "df")):
            _close(got, gp[name])


@pytest.mark.parametrize("inplace", [False, True])
def test_mlstm_step_routes_states(on_reference, inplace):
    """mlstm_step: (h, (C', n', m')) of one recurrence step; inplace writes the states into C, n, m."""
    g = _gen(8)
    B, NH, DK, DV = 2, 3, 8, 16
    q, k = torch.randn(B, NH, DK, generator=g), torch.randn(B, NH, DK, generator=g)
    v, i, f = torch.randn(B, NH, DV, generator=g), torch.randn(B, NH, generator=g), torch.randn(B, NH, generator=g)
    C, n, m = torch.randn(B, NH, DK, DV, generator=g), torch.randn(B, NH, DK, generator=g), torch.randn(B, NH, 1,
                                                                                                     generator=g)
    C_in, n_in, m_in = C.clone(), n.clone(), m.clone()
    h, (C2, n2, m2) = kspec.ops.mlstm_step(q, k, v, i, f, C, n, m, inplace=inplace)
    want_h, _, _, (wC, wn, wm) = mlstm_ref.mlstm_recurrent_fwd(
        *(_np(t)[:, :, None] for t in (q, k, v, i, f)), _np(C_in), _np(n_in), _np(m_in)[..., 0])
    _close(h, want_h[:, :, 0])
    for got, want in ((C2, wC), (n2, wn), (m2, wm[..., None])):
        _close(got, want)
    assert (C2 is C and n2 is n and m2 is m) == inplace
    assert inplace or torch.equal(C, C_in)


def test_mlstm_errors_name_the_argument():
    (q, k, v, i, f), (C0, n0, m0) = _mlstm_inputs(_gen(3), states=True)
    with pytest.raises(ValueError, match="c_initial, n_initial and m_initial go together"):
        kspec.ops.mlstm_chunkwise(q, k, v, i, f, c_initial=C0)
    with pytest.raises(ValueError, match="kernel='parallel' has no states"):
        kspec.ops.mlstm(q, k, v, i, f, C0, n0, m0, kernel="parallel")
    with pytest.raises(ValueError, match="kernel must be"):
        kspec.ops.mlstm(q, k, v, i, f, kernel="recurrent")


def _mhc_inputs(g, T=5, n=3, D=8, pre_only=False, gamma=True):
    M = n if pre_only else n * n + 2 * n
    x = torch.randn(T, n, D, generator=g, dtype=torch.float64)
    phi = (0.1 * torch.randn(M, n * D, generator=g)).float()
    alpha = torch.rand(1 if pre_only else 3, generator=g).float() + 0.5
    bias = (0.1 * torch.randn(M, generator=g)).float()
    gam = (1 + 0.1 * torch.randn(n * D, generator=g)).float() if gamma else None
    return x, phi, alpha, bias, gam


@pytest.mark.parametrize("pre_only", [False, True])
def test_mhc_pre_doors_agree_with_reference(on_reference, pre_only):
    g = _gen(4)
    x, phi, alpha, bias, gamma = _mhc_inputs(g, pre_only=pre_only)
    T, n, D = x.shape
    seeds = (torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, n, generator=g),
             torch.randn(T, n, generator=g), torch.randn(T, n, n, generator=g))[:2 if pre_only else 4]
    fwd = mhc_ref.mhc_pre_fwd(*(_np(t) for t in (x, phi, alpha, bias, gamma)), pre_only=pre_only)
    bwd = mhc_ref.mhc_pre_bwd(_np(seeds[0]), *(_np(t) for t in (x, phi, alpha, bias, gamma)),
                              *(_np(t) for t in seeds[1:]), *([None] * (3 - len(seeds[1:]))), pre_only=pre_only)

    def public(x, phi, alpha, bias, gamma):
        return kspec.ops.mhc_pre(x, phi, alpha, bias, gamma, pre_only=pre_only)

    def custom(x, phi, alpha, bias, gamma):
        if pre_only:
            return torch.ops.kspec.mhc_pre_only_fwd(x, phi, alpha, bias, gamma, 1e-6, 1e-6)[:2]
        return torch.ops.kspec.mhc_pre_fwd(x, phi, alpha, bias, gamma, 1e-6, 1e-6, 1e-6, 20)[:4]

    for outs, grads in _three_doors(public, custom, (x, phi, alpha, bias, gamma), seeds):
        for got, name in zip(outs, ("y", "h_pre", "h_post", "r")):
            _close(got, fwd[name])
        for got, name in zip(grads, ("dx", "dphi", "dalpha", "dbias", "dgamma")):
            _close(got, bwd[name])


def test_mhc_post_sinkhorn_and_layer(on_reference):
    g = _gen(5)
    x, phi, alpha, bias, gamma = _mhc_inputs(g)
    T, n, D = x.shape
    f = torch.randn(T, D, generator=g, dtype=torch.float64)
    h_post, h_res = torch.rand(T, n, generator=g).float(), torch.rand(T, n, n, generator=g).float()
    dout = torch.randn(T, n, D, generator=g, dtype=torch.float64)
    want = mhc_ref.mhc_post_bwd(*(_np(t) for t in (dout, x, f, h_post, h_res)))
    outs, grads = _grad(kspec.ops.mhc_post, (x, f, h_post, h_res), (dout,))
    _close(outs[0], mhc_ref.mhc_post_fwd(*(_np(t) for t in (x, f, h_post, h_res))))
    for got, name in zip(grads, ("dx", "df", "dh_post", "dr")):
        _close(got, want[name])

    logits = 3 * torch.randn(T, n, n, generator=g)
    dr = torch.randn(T, n, n, generator=g)
    for t_max in (1, 20):
        outs, (dlog,) = _grad(lambda z: kspec.ops.mhc_sinkhorn(z, t_max=t_max), (logits,), (dr,))
        _close(outs[0], mhc_ref.sinkhorn_fwd(_np(logits), t_max))
        _close(dlog, mhc_ref.sinkhorn_bwd(_np(logits), _np(dr), t_max))

    # the layer: pre, a sublayer, post; its gradient of x sums the post's and the pre's (y's and H's paths)
    lin = torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5
    out = kspec.ops.mhc_layer(x.requires_grad_(), lambda y: y @ lin, phi, alpha, bias, gamma)
    (dx,) = torch.autograd.grad(out, x, dout)
    p = mhc_ref.mhc_pre_fwd(*(_np(t) for t in (x, phi, alpha, bias, gamma)))
    fy = p["y"] @ _np(lin)
    _close(out, mhc_ref.mhc_post_fwd(_np(x), fy, p["h_post"], p["r"]))
    post = mhc_ref.mhc_post_bwd(_np(dout), _np(x), fy, p["h_post"], p["r"])
    pre = mhc_ref.mhc_pre_bwd(post["df"] @ _np(lin).T, *(_np(t) for t in (x, phi, alpha, bias, gamma)), None,
                              post["dh_post"], post["dr"], post["dx"])
    _close(dx, pre["dx"])


@pytest.mark.parametrize("gamma", [True, False])
def test_mhc_post_pre_doors_agree_with_post_then_pre(on_reference, gamma):
    """mhc_post_pre's outputs and every input's gradient (with a gradient on x_next and on each output of
    the next layer's pre) against the float64 post then pre."""
    g = _gen(8)
    x, phi, alpha, bias, gam = _mhc_inputs(g, gamma=gamma)
    T, n, D = x.shape
    f = torch.randn(T, D, generator=g, dtype=torch.float64)
    h_post, h_res = torch.rand(T, n, generator=g).float(), torch.rand(T, n, n, generator=g).float()
    seeds = (torch.randn(T, n, D, generator=g, dtype=torch.float64),
             torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, n, generator=g), torch.randn(T, n, generator=g), torch.randn(T, n, n, generator=g))
    npa = [_np(t) for t in (x, f, h_post, h_res, phi, alpha, bias)] + [None if gam is None else _np(gam)]
    fwd = mhc_ref.mhc_post_pre_fwd(*npa)
    bwd = mhc_ref.mhc_post_pre_bwd(*(_np(t) for t in seeds), *npa)
    leaves = (x, f, h_post, h_res, phi, alpha, bias) + ((gam,) if gamma else ())

    def public(x, f, h_post, h_res, phi, alpha, bias, *gm):
        return kspec.ops.mhc_post_pre(x, f, h_post, h_res, phi, alpha, bias, *gm)

    def custom(x, f, h_post, h_res, phi, alpha, bias, *gm):
        return torch.ops.kspec.mhc_post_pre_fwd(x, f, h_post, h_res, phi, alpha, bias, gm[0] if gm else None, 1e-6,
                                                1e-6, 1e-6, 20)[:5]

    for outs, grads in _three_doors(public, custom, leaves, seeds):
        for got, name in zip(outs, ("x_next", "y", "h_pre", "h_post", "r")):
            _close(got, fwd[name])
        for got, name in zip(grads, ("dx", "df", "dh_post", "dr", "dphi", "dalpha", "dbias", "dgamma")):
            _close(got, bwd[name])
    # Only y's gradient: x_next's and the H's absent (None into the backward op).
    outs, grads = _grad(public, leaves, (None, seeds[1]))
    want = mhc_ref.mhc_post_pre_bwd(None, _np(seeds[1]), None, None, None, *npa)
    for got, name in zip(grads, ("dx", "df", "dh_post", "dr", "dphi")):
        _close(got, want[name])


def test_hyper_connection_stack_fuses_and_matches_layers_in_turn(on_reference, monkeypatch):
    """HyperConnectionStack gives layer(x) in turn, forward and gradients, running post_pre between layers;
    bad layers are refused naming the index."""
    g = _gen(10)
    B, S, n, D = 2, 3, 3, 8
    x = torch.randn(B, S, n, D, generator=g, dtype=torch.float64)
    layers = []
    for _ in range(3):
        hc = kspec.nn.HyperConnection(D, n, torch.nn.Linear(D, D, dtype=torch.float64))
        with torch.no_grad():  # away from the plain-residual start, so every path carries weight
            hc.phi.normal_(0, 0.1, generator=g)
            hc.bias.add_(0.1 * torch.randn(hc.bias.shape, generator=g))
        layers.append(hc)
    stack = kspec.nn.HyperConnectionStack(layers)
    fused = []
    monkeypatch.setattr(_mhc, "post_pre", lambda *a, _f=_mhc.post_pre: fused.append(1) or _f(*a))
    xa = x.clone().requires_grad_()
    out = stack(xa)
    assert len(fused) == 2
    out.square().sum().backward()
    got = [xa.grad] + [p.grad.clone() for p in stack.parameters()]
    stack.zero_grad()
    xb = x.clone().requires_grad_()
    want_out = xb
    for layer in layers:
        want_out = layer(want_out)
    want_out.square().sum().backward()
    _close(out, _np(want_out.detach()))
    for a, b in zip(got, [xb.grad] + [p.grad for p in stack.parameters()]):
        _close(a, _np(b))
    assert set(stack.state_dict()) >= {"layers.0.phi", "layers.2.sublayer.weight"}
    with pytest.raises(ValueError, match=r"layers\[1\] must be a HyperConnection with a sublayer"):
        kspec.nn.HyperConnectionStack([layers[0], kspec.nn.HyperConnection(D, n)])
    with pytest.raises(ValueError, match=r"layers\[1\] has dim=8, n=2"):
        kspec.nn.HyperConnectionStack([layers[0], kspec.nn.HyperConnection(D, 2, torch.nn.Identity())])


def test_mhc_inference_is_one_call_of_the_forward_op(on_reference, monkeypatch):
    """Under torch.no_grad (a decode step) kspec.ops.mhc_pre/_post/_post_pre and the modules make one kspec.call
    of the forward op each, never the Surface's planning (autograd's entry), with the reference's outputs; the pre
    ops without inv and h (save_stats=False)."""
    g = _gen(11)
    x, phi, alpha, bias, gamma = _mhc_inputs(g)
    T, n, D = x.shape
    f = torch.randn(T, D, generator=g, dtype=torch.float64)
    h_post, h_res = torch.rand(T, n, generator=g).float(), torch.rand(T, n, n, generator=g).float()
    ops, saves, real = [], [], _mhc.call
    monkeypatch.setattr(_mhc, "call", lambda op, *a, **k: ops.append(op) or saves.append(k.get("save_stats")) or
                        real(op, *a, **k))
    monkeypatch.setattr(_surface.Surface, "__call__", lambda *a: pytest.fail("the Surface ran under no_grad"))
    with torch.no_grad():
        y, h_pre, hp, r = kspec.ops.mhc_pre(x, phi, alpha, bias, gamma)
        out = kspec.ops.mhc_post(x, f, h_post, h_res)
        x_next, y2 = kspec.ops.mhc_post_pre(x, f, h_post, h_res, phi, alpha, bias, gamma)[:2]
        kspec.ops.mhc_pre(x, phi[:n], alpha[:1], bias[:n], gamma, pre_only=True)
        hc = kspec.nn.HyperConnection(D, n, torch.nn.Identity())
        kspec.nn.HyperConnectionStack([hc, kspec.nn.HyperConnection(D, n, torch.nn.Identity())])(x)
    assert ops == ["mhc.pre.fwd", "mhc.post.fwd", "mhc.post_pre.fwd", "mhc.pre_only.fwd", "mhc.pre.fwd",
                   "mhc.post_pre.fwd", "mhc.post.fwd"]
    # no backward to follow: the pre ops keep neither inv nor h (save_stats=False: two outputs fewer to allocate)
    assert [s for o, s in zip(ops, saves) if o in ("mhc.pre.fwd", "mhc.pre_only.fwd")] == [False] * 3, saves
    want = mhc_ref.mhc_pre_fwd(*(_np(t) for t in (x, phi, alpha, bias, gamma)))
    _close(y, want["y"])
    _close(r, want["r"])
    _close(out, mhc_ref.mhc_post_fwd(*(_np(t) for t in (x, f, h_post, h_res))))
    pp = mhc_ref.mhc_post_pre_fwd(*(_np(t) for t in (x, f, h_post, h_res, phi, alpha, bias, gamma)))
    _close(x_next, pp["x_next"])
    _close(y2, pp["y"])


def test_logic_layer_doors_agree_with_reference(on_reference):
    g = _gen(6)
    B, n_in, n_out = 9, 7, 12
    x = torch.rand(B, n_in, generator=g, dtype=torch.float64)
    logits = torch.randn(n_out, 16, generator=g)
    a, b = torch.randint(0, n_in, (n_out,), generator=g), torch.randint(0, n_in, (n_out,), generator=g)
    b[:3] = a[:3]  # self-paired gates
    dy = torch.randn(B, n_out, generator=g, dtype=torch.float64)
    a32, b32 = a.int(), b.int()
    csr = _difflogic.consumers(n_in, a32, b32)
    want_y = dl_ref.layer_fwd(_np(x), _np(logits), a.numpy(), b.numpy())
    want_dx, want_dl = dl_ref.layer_bwd(_np(dy), _np(x), _np(logits), a.numpy(), b.numpy(), 2.0)

    def public(x, logits):
        return kspec.ops.logic_layer(x, logits, a, b, grad_factor=2.0)

    def custom(x, logits):
        return torch.ops.kspec.logic_layer_fwd(x, logits, a32, b32, csr, "soft", 2.0)

    for outs, (dx, dl) in _three_doors(public, custom, (x, logits), (dy,)):
        _close(outs[0], want_y)
        _close(dx, want_dx)
        _close(dl, want_dl)
    off, ent = dl_ref.consumers(n_in, a.numpy(), b.numpy())
    assert csr.tolist() == off.tolist() + ent.tolist()
    hard = kspec.ops.logic_layer(x, logits, a, b, mode="hard")
    _close(hard, dl_ref.layer_fwd(_np(x), _np(logits), a.numpy(), b.numpy(), hard=True))


def test_opcheck_generated_ops(on_reference):
    g = _gen(7)
    (q, k, v, i, f), _ = _mlstm_inputs(g, S=9)
    torch.library.opcheck(torch.ops.kspec.mlstm_parallel_fwd.default, (q, k, v, i, f, 1e-6, True))
    x, phi, alpha, bias, gamma = _mhc_inputs(g)
    torch.library.opcheck(torch.ops.kspec.mhc_pre_fwd.default, (x, phi, alpha, bias, gamma, 1e-6, 1e-6, 1e-6, 20),
                          test_utils=("test_schema", "test_faketensor"))
    T, n, D = x.shape
    torch.library.opcheck(torch.ops.kspec.mhc_post_fwd.default,
                          (x, torch.randn(T, D, dtype=torch.float64), torch.rand(T, n), torch.rand(T, n, n)),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kspec.mhc_post_pre_fwd.default,
                          (x, torch.randn(T, D, dtype=torch.float64), torch.rand(T, n), torch.rand(T, n, n), phi, alpha,
                           bias, gamma, 1e-6, 1e-6, 1e-6, 20), test_utils=("test_schema", "test_faketensor"))
    a = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    xs = torch.rand(3, 3, dtype=torch.float64)
    torch.library.opcheck(torch.ops.kspec.logic_layer_fwd.default,
                          (xs, torch.randn(4, 16), a, a.flip(0).contiguous(), _difflogic.consumers(3, a, a.flip(0)),
                           "soft", 1.0), test_utils=("test_schema", "test_faketensor"))


def test_difflogic_wires_pack_and_modules():
    x = torch.rand(4, 5)
    with pytest.raises(ValueError, match=r"wires must lie in \[0, n_in\) = \[0, 5\)"):
        kspec.ops.logic_layer(x, torch.randn(2, 16), torch.tensor([0, 5]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="one length"):
        kspec.ops.logic_layer(x, torch.randn(2, 16), torch.tensor([0, 1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="must be an integer tensor"):
        kspec.ops.logic_layer(x, torch.randn(2, 16), torch.tensor([0., 1.]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="mode must be"):
        kspec.ops.logic_layer(x, torch.randn(2, 16), torch.tensor([0, 1]), torch.tensor([1, 2]), mode="gumbel")
    for w in (32, 64):
        bits = (torch.rand(w + 3, 6) > 0.5).to(torch.uint8)  # a batch not a multiple of w: padding bits
        words = kspec.ops.difflogic_pack(bits, w)
        assert words.shape == (6, 2) and words.dtype == (torch.int32 if w == 32 else torch.int64)
        assert np.array_equal(words.numpy().view(np.uint32 if w == 32 else np.uint64).astype(np.uint64),
                              dl_ref.pack(bits.numpy(), w))
        assert torch.equal(kspec.ops.difflogic_unpack(words, w + 3), bits)
        assert kspec.ops.difflogic_packed_group_sum(words, w + 3, 3).tolist() == \
            dl_ref.packed_group_sum(dl_ref.pack(bits.numpy(), w), w + 3, w, 3).tolist()
    with pytest.raises(ValueError, match=r"difflogic_packed_net: layer 1: wires must lie in \[0, n_in\) = \[0, 4\)"):
        kspec.ops.difflogic_packed_net(words, [(torch.randn(4, 16), torch.arange(4), torch.arange(4)),
                                               (torch.randn(2, 16), torch.tensor([0, 4]), torch.tensor([1, 2]))], 67, 2)
    # LogicLayer: difflogic's draw (weights, then the wiring from the CPU generator), in the state dict
    torch.manual_seed(0)
    layer = kspec.nn.LogicLayer(6, 8, device="cpu")
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    slots = torch.randperm(16) % 6
    wires = torch.randperm(6)[slots].reshape(2, 8)
    assert torch.equal(layer.weights.detach(), w) and torch.equal(layer.indices, wires)
    assert set(layer.state_dict()) == {"weights", "indices"}
    with pytest.raises(ValueError, match=r"in \[0, n_in\) = \[0, 6\)"):
        layer.set_wiring(torch.tensor([0] * 7 + [6]), torch.zeros(8, dtype=torch.long))
    assert kspec.nn.GroupSum(2, tau=2.0)(torch.ones(3, 8)).tolist() == [[2.0, 2.0]] * 3


def test_from_difflogic_keeps_weights_wiring_and_mode():
    """A difflogic model (classes named as difflogic's, indices a tuple of wires) becomes kspec's layers with
    the same weights, wiring, grad_factor and mode; other modules are kept; the model is unchanged."""
    class LogicLayer(torch.nn.Module):  # difflogic's attributes
        def __init__(self, in_dim, out_dim):
            super().__init__()
            self.in_dim, self.out_dim, self.grad_factor = in_dim, out_dim, 2.0
            self.weights = torch.nn.Parameter(torch.randn(out_dim, 16))
            self.indices = (torch.randint(0, in_dim, (out_dim,)), torch.randint(0, in_dim, (out_dim,)))

    class GroupSum(torch.nn.Module):
        def __init__(self, k, tau):
            super().__init__()
            self.k, self.tau = k, tau

    model = torch.nn.Sequential(torch.nn.Flatten(), LogicLayer(6, 8), LogicLayer(8, 4), GroupSum(2, 3.0)).eval()
    got = kspec.nn.from_difflogic(model)
    assert isinstance(got[1], kspec.nn.LogicLayer) and isinstance(got[3], kspec.nn.GroupSum)
    assert isinstance(got[0], torch.nn.Flatten) and type(model[1]) is LogicLayer  # the model is unchanged
    for ours, theirs in ((got[1], model[1]), (got[2], model[2])):
        assert torch.equal(ours.weights, theirs.weights) and ours.weights is not theirs.weights
        assert torch.equal(ours.indices, torch.stack(theirs.indices)) and ours.grad_factor == 2.0
        assert not ours.training
    assert (got[3].k, got[3].tau) == (2, 3.0)


def test_hyper_connection_starts_as_a_plain_residual(on_reference):
    """At initialisation out[k] ~ x[k] + sublayer(mean of the streams) (H_pre = 1/n, H_post = 1, R ~ I), the
    head gives the mean; every parameter gets a gradient; DeepSeek-V4's tensors load by shape."""
    g = _gen(9)
    B, S, n, D = 2, 3, 4, 8
    x = kspec.nn.mhc_expand(torch.randn(B, S, D, generator=g, dtype=torch.float64), n)
    x = x + 0.1 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    assert x.shape == (B, S, n, D) and x.is_contiguous()
    lin = torch.nn.Linear(D, D, dtype=torch.float64)
    hc = kspec.nn.HyperConnection(D, n, lin)
    out = hc(x)
    want = x + lin(x.mean(dim=-2)).unsqueeze(-2)
    assert out.shape == x.shape and (out - want).abs().max() <= 1e-3 * want.abs().max()
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in (hc.phi, hc.alpha, hc.bias, hc.gamma))
    assert hc.phi.grad.abs().sum() > 0
    head = kspec.nn.HyperConnectionHead(D, n)
    assert (head(x) - x.mean(dim=-2)).abs().max() <= 1e-5 * x.abs().max()
    M = n * n + 2 * n
    hc.load_deepseek(torch.ones(M, n * D), torch.full((3,), 0.5), torch.zeros(M))
    assert torch.equal(hc.alpha.detach(), torch.full((3,), 0.5))
    with pytest.raises(ValueError, match=r"fn must be \(24, 32\)"):
        hc.load_deepseek(torch.ones(M, D), torch.ones(3), torch.zeros(M))


def test_group_sum_surface_on_reference(on_reference):
    """GroupSum's torch surface (kspec.ops.group_sum, kspec::group_sum_fwd/_bwd): y and dx of the references."""
    s = _surface.FAMILIES["group_sum"]
    s.fwd_op.register_kernel("cpu", s.fwd_kernel)
    s.bwd_op.register_kernel("cpu", s.bwd_kernel)
    g = _gen(9)
    x = torch.rand(2, 5, 12, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    (y,), (dx,) = _grad(lambda x: kspec.ops.group_sum(x, 3, tau=2.0), (x,), (dy,))
    _close(y, dl_ref.group_sum(_np(x).reshape(10, 12), 3, 2.0).reshape(2, 5, 3))
    _close(dx, dl_ref.group_sum_bwd(_np(dy).reshape(10, 3), 12, 2.0).reshape(2, 5, 12))
    with pytest.raises(ValueError, match=r"must be a multiple of k = 5"):
        kspec.ops.group_sum(x, 5)
