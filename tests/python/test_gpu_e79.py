"""e79 on the GPU through Python: the cell (kspec.ops.e79_cell, autograd) and the projected op
(kspec.ops.e79: kspec's gemm + the cell) against the float64 reference, every gradient (the fused
projection's columns, fixed biases, S0, M0, with and without upstream dS, dM), for each bias mode and
dtype; named edge cases (T=1, T=2, T=K, T=K+1, T not a multiple of K, B=1, B=33, n=8, n=128), every
layout of the projection, a 4096-step bf16 sequence, kspec.nn against the torch reference module, and
clear errors for bad input; the cluster configs (one sequence over a thread-block cluster, sm_90+) on
their own cases, bitwise reproducible; torch.compile (fullgraph, inductor) through the custom ops
kspec::e79_fwd/e79_bwd: the cell, the projected op with dynamic shapes, kspec.nn.E79Cell and
E79CoupledMatrix forward+backward in one frame each, matching eager, and torch.library.opcheck of the
ops. A failure message lists every tensor's relative error."""
import numpy as np
import pytest

from helpers import TOL, rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import e79 as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BIAS = ["none", "fixed", "input"]
SCALE = 4.0  # OpDef::tolerance_scale: fp32 through recurrences of tens to ~1000 steps


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


def _tol(dtype, scale=SCALE):
    return TOL[str(dtype).split(".")[1]] * scale


def _name(d):
    return str(d).split(".")[1]


# name: (T, B, n, chunk, init, dfinal)
CASES = {
    "T_1_B_1": (1, 1, 32, 16, True, True),
    "T_2_B_1": (2, 1, 32, 16, True, True),
    "T_eq_K": (16, 2, 32, 16, True, True),
    "T_K_plus_1": (17, 2, 32, 16, True, True),
    "T_not_multiple_of_K": (45, 2, 32, 8, True, True),
    "B_1": (30, 1, 32, 8, True, True),
    "B_33": (20, 33, 16, 8, True, True),
    "n_8": (25, 3, 8, 8, True, True),
    "n_48": (19, 2, 48, 8, True, True),
    "n_64": (19, 2, 64, 8, True, True),
    "n_96": (11, 2, 96, 4, True, True),
    "n_128": (11, 2, 128, 4, True, True),
    "no_init_no_dfinal": (20, 2, 32, 8, False, False),
    "n_16_K_4": (9, 2, 16, 4, True, True),
    "chunk_1": (7, 2, 32, 1, True, True),
    "chunk_5_odd": (23, 2, 32, 5, True, True),
}


def _inputs(T, B, n, bias, dtype, init, seed, batch_first=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rn(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(dt)

    C = (6 if bias == "input" else 4) * n
    if batch_first:  # storage (B, T, C), seen as (T, B, C)
        kvqm = rn(B, T, C).transpose(0, 1)
    else:
        kvqm = rn(T, B, C)
    b_s = rn(n, scale=0.5) if bias == "fixed" else None
    b_m = rn(n, scale=0.5) if bias == "fixed" else None
    S0 = rn(B, n, n, scale=0.3, dt=torch.float32) if init else None
    M0 = rn(B, n, n, scale=0.3, dt=torch.float32) if init else None
    return kvqm, b_s, b_m, S0, M0


def _split(a, n, bias):
    """kvqm (T, B, C) numpy -> k, v, q, m, b_s, b_m (per step in input mode)."""
    cols = [a[..., j * n:(j + 1) * n] for j in range(6 if bias == "input" else 4)]
    return cols + ([None, None] if bias != "input" else [])


def _check_cell(T, B, n, chunk, init, dfinal, bias, dtype, batch_first=False, seed=0, scale=SCALE, config=None):
    kvqm, b_s, b_m, S0, M0 = _inputs(T, B, n, bias, dtype, init, seed, batch_first)
    leaves = {k: (t.detach().clone().requires_grad_() if t is not None else None)
              for k, t in dict(kvqm=kvqm, b_s=b_s, b_m=b_m, S0=S0, M0=M0).items()}
    if batch_first:  # keep the batch-first storage for the leaf too
        leaves["kvqm"] = kvqm.transpose(0, 1).detach().clone().requires_grad_()
        x_in = leaves["kvqm"].transpose(0, 1)
    else:
        x_in = leaves["kvqm"]
    out, S, M = kspec.ops.e79_cell(x_in, n, leaves["b_s"], leaves["b_m"], leaves["S0"], leaves["M0"], bias=bias,
                                   chunk=chunk, config=config)
    assert out.shape == (T, B, n) and out.dtype == dtype
    assert S.shape == (B, n, n) and S.dtype == torch.float32 and M.shape == (B, n, n)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
    dS = torch.randn(S.shape, device="cuda", generator=g) if dfinal else None
    dM = torch.randn(M.shape, device="cuda", generator=g) if dfinal else None
    if dfinal:
        torch.autograd.backward([out, S, M], [dout, dS, dM])
    else:
        out.backward(dout)

    a = _np(kvqm)
    k, v, q, m, bs_t, bm_t = _split(a, n, bias)
    bs = _np(b_s) if bias == "fixed" else bs_t
    bm = _np(b_m) if bias == "fixed" else bm_t
    out_r, S_r, M_r = ref.e79_fwd(k, v, q, m, bs, bm, _np(S0), _np(M0))
    gr = ref.e79_bwd(_np(dout), k, v, q, m, bs, bm, _np(S0), _np(M0), dS=_np(dS), dM=_np(dM))
    errs = {"out": rel_err(_np(out), out_r), "S": rel_err(_np(S), S_r), "M": rel_err(_np(M), M_r)}
    gk = leaves["kvqm"].grad
    assert gk is not None
    gk = _np(gk.transpose(0, 1) if batch_first else gk)
    names = ["dk", "dv", "dq", "dm"] + (["db_s", "db_m"] if bias == "input" else [])
    for j, name in enumerate(names):
        errs[name] = rel_err(gk[..., j * n:(j + 1) * n], gr[name])
    if bias == "fixed":
        errs["db_s"] = rel_err(_np(leaves["b_s"].grad), gr["db_s"])
        errs["db_m"] = rel_err(_np(leaves["b_m"].grad), gr["db_m"])
    if init:
        errs["dS0"] = rel_err(_np(leaves["S0"].grad), gr["dS0"])
        errs["dM0"] = rel_err(_np(leaves["M0"].grad), gr["dM0"])
    tol = _tol(dtype, scale)
    bad = {k_: e for k_, e in errs.items() if not e <= tol}
    where = f"T={T} B={B} n={n} chunk={chunk} bias={bias} {_name(dtype)} init={init} dfinal={dfinal} config={config}"
    assert not bad, f"{where}: errors above {tol}: {bad} (all: {errs})"


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("case", list(CASES))
def test_cell_forward_and_gradients_match_reference(case, bias, dtype):
    T, B, n, chunk, init, dfinal = CASES[case]
    _check_cell(T, B, n, chunk, init, dfinal, bias, dtype)


@pytest.mark.parametrize("bias", BIAS)
def test_cell_batch_first_storage(bias):
    _check_cell(21, 3, 32, 8, True, True, bias, torch.float32, batch_first=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_cell_long_1024_matches_reference(dtype):
    _check_cell(1024, 1, 32, 32, True, True, "fixed", dtype, scale=8.0)


def test_long_4096_bf16_stays_finite():
    T, B, n = 4096, 2, 64
    kvqm, b_s, b_m, S0, M0 = _inputs(T, B, n, "fixed", torch.bfloat16, False, 7)
    kvqm.requires_grad_()
    b_s.requires_grad_()
    out, S, M = kspec.ops.e79_cell(kvqm, n, b_s, b_m, bias="fixed", chunk=32)
    out.float().square().mean().backward()
    for name, t in dict(out=out, S=S, M=M, dkvqm=kvqm.grad, db_s=b_s.grad).items():
        assert torch.isfinite(t).all(), name
    # The forward's last steps against the reference run over the whole sequence.
    a = _np(kvqm)
    k, v, q, m = (a[..., j * n:(j + 1) * n] for j in range(4))
    out_r, S_r, _ = ref.e79_fwd(k, v, q, m, _np(b_s), _np(b_m))
    assert rel_err(_np(out)[-64:], out_r[-64:]) <= 2e-2
    assert rel_err(_np(S), S_r) <= 2e-2


# ---- the projected op: x -> gemm -> cell, every layout ----

LAYOUTS = ["contiguous", "batch_first", "x_transposed_view", "weight_transposed_view"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", BIAS)
def test_projected_every_layout(layout, bias):
    T, B, dim, n = 13, 3, 40, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    rn = lambda *s, scale=1.0: scale * torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x_tbd = rn(T, B, dim)
    W = rn(4 * n, dim, scale=dim ** -0.5)
    W_bs, W_bm = rn(n, dim, scale=dim ** -0.5), rn(n, dim, scale=dim ** -0.5)
    b_s, b_m = rn(n), rn(n)
    S0, M0 = rn(B, n, n, scale=0.3), rn(B, n, n, scale=0.3)
    batch_first = layout == "batch_first"
    if batch_first:
        x = x_tbd.transpose(0, 1).contiguous().requires_grad_()
    elif layout == "x_transposed_view":  # (T, B, dim) view of batch-first storage
        xs = x_tbd.transpose(0, 1).contiguous().requires_grad_()
        x = xs.transpose(0, 1)
    else:
        x = x_tbd.clone().requires_grad_()
    if layout == "weight_transposed_view":
        Wt = W.t().contiguous().requires_grad_()
        Wl = Wt.t()
    else:
        Wl = W.clone().requires_grad_()
    params = dict(b_s=b_s.clone().requires_grad_(), b_m=b_m.clone().requires_grad_(),
                  W_bs=W_bs.clone().requires_grad_(), W_bm=W_bm.clone().requires_grad_(),
                  S0=S0.clone().requires_grad_(), M0=M0.clone().requires_grad_())
    kw = dict(S0=params["S0"], M0=params["M0"])
    if bias == "fixed":
        kw.update(b_s=params["b_s"], b_m=params["b_m"])
    if bias == "input":
        kw.update(W_bs=params["W_bs"], W_bm=params["W_bm"])
    out, S, M = kspec.ops.e79(x, Wl, bias=bias, batch_first=batch_first, chunk=4, **kw)
    assert out.shape == ((B, T, n) if batch_first else (T, B, n))
    dout = rn(*out.shape)
    dS, dM = rn(B, n, n), rn(B, n, n)
    torch.autograd.backward([out, S, M], [dout, dS, dM])

    # float64: the projection, the cell, and the projection's gradients.
    x64, W64 = _np(x_tbd), _np(W)
    Wall = np.concatenate([W64, _np(W_bs), _np(W_bm)]) if bias == "input" else W64
    proj = x64 @ Wall.T
    k, v, q, m, bs_t, bm_t = _split(proj, n, bias)
    bs = _np(b_s) if bias == "fixed" else bs_t
    bm = _np(b_m) if bias == "fixed" else bm_t
    out_r, S_r, M_r = ref.e79_fwd(k, v, q, m, bs, bm, _np(S0), _np(M0))
    dout64 = _np(dout.transpose(0, 1) if batch_first else dout)
    gr = ref.e79_bwd(dout64, k, v, q, m, bs, bm, _np(S0), _np(M0), dS=_np(dS), dM=_np(dM))
    dproj = np.concatenate([gr[k_] for k_ in ["dk", "dv", "dq", "dm"] + (["db_s", "db_m"] if bias == "input" else [])],
                           axis=-1)
    dx_r = dproj @ Wall
    dW_r = np.einsum("tbc,tbd->cd", dproj, x64)
    out64 = _np(out.transpose(0, 1) if batch_first else out)
    xg = x.grad if layout != "x_transposed_view" else xs.grad
    dx = _np(xg.transpose(0, 1) if layout in ("batch_first", "x_transposed_view") else xg)
    dW = _np(Wt.grad.t() if layout == "weight_transposed_view" else Wl.grad)
    errs = {"out": rel_err(out64, out_r), "S": rel_err(_np(S), S_r), "M": rel_err(_np(M), M_r),
            "dx": rel_err(dx, dx_r), "dW_kvqm": rel_err(dW, dW_r[:4 * n]),
            "dS0": rel_err(_np(params["S0"].grad), gr["dS0"]), "dM0": rel_err(_np(params["M0"].grad), gr["dM0"])}
    if bias == "fixed":
        errs["db_s"] = rel_err(_np(params["b_s"].grad), gr["db_s"])
        errs["db_m"] = rel_err(_np(params["b_m"].grad), gr["db_m"])
    if bias == "input":
        errs["dW_bs"] = rel_err(_np(params["W_bs"].grad), dW_r[4 * n:5 * n])
        errs["dW_bm"] = rel_err(_np(params["W_bm"].grad), dW_r[5 * n:])
    tol = 1e-4  # fp32 GEMMs (no TF32) and the cell
    bad = {k_: e for k_, e in errs.items() if not e <= tol}
    assert not bad, f"{layout} {bias}: errors above {tol}: {bad} (all: {errs})"


# ---- kspec.nn against the torch reference modules ----

@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("use_conv", [False, True])
def test_nn_layer_matches_reference_module(bias, use_conv):
    from kspec.reference.e79_torch import E79CoupledMatrix as RefLayer

    torch.manual_seed(0)
    ref_layer = RefLayer(48, n_state=16, use_conv=use_conv, use_bias=bias != "none",
                         input_bias=bias == "input").cuda()
    layer = kspec.nn.E79CoupledMatrix(48, n_state=16, use_conv=use_conv, bias=bias, chunk=4).cuda()
    layer.load_state_dict(ref_layer.state_dict(), strict=True)
    x = torch.randn(3, 21, 48, device="cuda")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, (Sa, Ma) = layer(xa)
    yb, (Sb, Mb) = ref_layer(xb)
    (ya.square().sum() + Sa.sum() + Ma.sum()).backward()
    (yb.square().sum() + Sb.sum() + Mb.sum()).backward()
    errs = {"y": rel_err(_np(ya), _np(yb)), "S": rel_err(_np(Sa), _np(Sb)), "M": rel_err(_np(Ma), _np(Mb)),
            "dx": rel_err(_np(xa.grad), _np(xb.grad))}
    pa, pb = dict(layer.named_parameters()), dict(ref_layer.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        errs["d" + name] = rel_err(_np(pa[name].grad), _np(pb[name].grad))
    bad = {k_: e for k_, e in errs.items() if not e <= 1e-4}
    assert not bad, f"{bias} conv={use_conv}: {bad} (all: {errs})"


def test_nn_cell_bf16_runs_with_fp32_biases():
    cell = kspec.nn.E79Cell(64, 32, bias="fixed").cuda()
    x = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, S, M = cell(x)
    assert out.dtype == torch.bfloat16 and S.dtype == torch.float32
    out.float().sum().backward()
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(cell.b_s_gate.grad).all()


# ---- errors and the raw ops ----

def test_bad_inputs_name_the_problem():
    kvqm = torch.randn(5, 2, 4 * 32, device="cuda")
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        kspec.ops.e79_cell(kvqm.cpu(), 32, bias="none")
    with pytest.raises(NotImplementedError, match="n = 20 is not supported"):
        kspec.ops.e79_cell(torch.randn(5, 2, 80, device="cuda"), 20, bias="none")
    with pytest.raises(ValueError, match=r"kvqm must be \(T, B, 4n\)"):
        kspec.ops.e79_cell(kvqm, 16, bias="none")
    with pytest.raises(ValueError, match="input 'S0'"):
        kspec.ops.e79_cell(kvqm, 32, S0=torch.zeros(3, 32, 32, device="cuda"), bias="none")
    with pytest.raises(ValueError, match="bias must be one of"):
        kspec.ops.e79_cell(kvqm, 32, bias="learned")
    with pytest.raises(ValueError, match="input 'v'"):
        k = torch.randn(5, 2, 32, device="cuda")
        kspec.call("e79.fwd", k, k.half(), k, k, None, None, None, None)


def test_inference_keeps_no_checkpoints_and_matches_training_forward():
    kvqm, b_s, b_m, S0, M0 = _inputs(40, 2, 32, "fixed", torch.float32, True, 5)
    with torch.no_grad():
        out_a, S_a, _ = kspec.ops.e79_cell(kvqm, 32, b_s, b_m, S0, M0, bias="fixed")
    out_b, S_b, _ = kspec.ops.e79_cell(kvqm.clone().requires_grad_(), 32, b_s, b_m, S0, M0, bias="fixed")
    assert rel_err(_np(out_a), _np(out_b)) <= 1e-6 and rel_err(_np(S_a), _np(S_b)) <= 1e-6
    assert kspec.ops.e79_checkpoint_bytes_per_token(64, 16) == 2048


def test_cpp_checker_from_python():
    for op in ("e79.fwd", "e79.bwd"):
        for case in ("base", "T_1_B_1", "n_128", "bias_input"):
            rows = kspec.check(op, case=case)
            assert rows and all(r["passed"] for r in rows), rows


# ---- one sequence over a thread-block cluster (e79_cluster.cuh) ----

# name: (T, B, n, chunk, config)
CLUSTER_CASES = {
    "B_1_n_8_cluster_2": (23, 1, 8, 8, "split=8,cluster=2"),
    "B_1_n_128_cluster_8": (13, 1, 128, 8, "split=32,cluster=8"),
    "B_1_n_128_cluster_2": (9, 1, 128, 4, "split=8,cluster=2"),
    "B_1_n_64_cluster_4_T_not_multiple_of_K": (45, 1, 64, 8, "split=16,cluster=4"),
    "B_3_n_32_cluster_2_split_2": (20, 3, 32, 16, "split=2,cluster=2"),
    "B_2_n_48_cluster_8": (19, 2, 48, 8, "split=16,cluster=8"),
    "B_1_n_96_cluster_4_chunk_1": (6, 1, 96, 1, "split=8,cluster=4"),
    "B_2_n_16_cluster_4_T_1": (1, 2, 16, 16, "split=8,cluster=4"),
}


def _need_clusters():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90 or newer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("case", list(CLUSTER_CASES))
def test_cluster_cell_matches_reference(case, bias, dtype):
    _need_clusters()
    T, B, n, chunk, config = CLUSTER_CASES[case]
    _check_cell(T, B, n, chunk, True, True, bias, dtype, config=config)


@pytest.mark.parametrize("bias", BIAS)
def test_cluster_batch_first_without_init_or_dfinal(bias):
    _need_clusters()
    _check_cell(21, 3, 64, 8, False, False, bias, torch.float32, batch_first=True, config="split=32,cluster=8")


def test_cluster_runs_are_bitwise_identical():
    """Every CTA adds the exchanged partials in the same fixed order: two runs give the same bits."""
    _need_clusters()
    kvqm, b_s, b_m, S0, M0 = _inputs(37, 2, 64, "fixed", torch.bfloat16, True, 11)
    dout = torch.randn(37, 2, 64, device="cuda").to(torch.bfloat16)

    def run():
        x = kvqm.detach().clone().requires_grad_()
        bs, bm = b_s.detach().clone().requires_grad_(), b_m.detach().clone().requires_grad_()
        out, S, M = kspec.ops.e79_cell(x, 64, bs, bm, S0, M0, bias="fixed", chunk=8, config="split=16,cluster=4")
        out.backward(dout)
        return [out, S, M, x.grad, bs.grad, bm.grad]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_cluster_config_needs_its_rules():
    """A forced config the tuning space rules out names the rule."""
    kvqm, b_s, b_m, S0, M0 = _inputs(5, 1, 32, "fixed", torch.float32, False, 3)
    with pytest.raises(Exception, match="split must be at least cluster|need sm_90"):
        kspec.ops.e79_cell(kvqm, 32, b_s, b_m, bias="fixed", config="split=2,cluster=4")


# ---- torch.compile through the custom ops kspec::e79_fwd, kspec::e79_bwd (no graph break) ----

def _compile_counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend("inductor")


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("bias", BIAS)
def test_compiled_cell_fullgraph_matches_eager(bias, dtype, batch_first):
    """One frame; the same kernels as the eager autograd Function, so the same outputs and gradients."""
    from test_e79_custom_op import check_compiled_cell

    torch._dynamo.reset()
    check_compiled_cell(bias, dtype, "cuda", batch_first, "inductor", tol=1e-6, T=45, B=3, n=32, chunk=8,
                        bias_dtype=torch.float32)


@pytest.mark.parametrize("bias", BIAS)
def test_compiled_cell_fullgraph_with_cluster_heuristic(bias):
    """n = 64 at B = 2: the heuristic's cluster config on sm_90 (one CTA per sequence elsewhere)."""
    from test_e79_custom_op import check_compiled_cell

    torch._dynamo.reset()
    check_compiled_cell(bias, torch.bfloat16, "cuda", True, "inductor", tol=1e-6, T=37, B=2, n=64, chunk=8,
                        bias_dtype=torch.float32)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", BIAS)
def test_custom_ops_pass_opcheck(bias, batch_first):
    from test_e79_custom_op import make_inputs

    n, chunk = 16, 4
    inp = make_inputs(11, 3, n, bias, torch.float32, "cuda", batch_first)
    args = (inp["kvqm"], inp["b_s"], inp["b_m"], inp["S0"], inp["M0"], n, bias, chunk, None, True)
    torch.library.opcheck(torch.ops.kspec.e79_fwd.default, args)
    with torch.no_grad():
        chk = torch.ops.kspec.e79_fwd(*args)[3]
    detached = [None if t is None else t.detach() for t in args[:5]]
    dout = torch.randn(11, 3, n, device="cuda")
    bwd_args = (dout, *detached, chk, torch.randn(3, n, n, device="cuda"), None, n, bias, chunk, None)
    torch.library.opcheck(torch.ops.kspec.e79_bwd.default, bwd_args)


def test_compiled_projected_op_dynamic_shapes_is_one_graph():
    """kspec.ops.e79 (gemm + cell, batch-first) under dynamic=True, as tools/bench/e79.py compiles
    it: other T and B reuse the one graph; outputs and every gradient as eager."""
    counter = _compile_counter()
    n, dim = 32, 48
    g = torch.Generator(device="cuda").manual_seed(5)
    W = (dim ** -0.5 * torch.randn(4 * n, dim, device="cuda", generator=g)).requires_grad_()
    b_s = (0.5 * torch.randn(n, device="cuda", generator=g)).requires_grad_()
    b_m = (0.5 * torch.randn(n, device="cuda", generator=g)).requires_grad_()

    def f(x, W, b_s, b_m):
        return kspec.ops.e79(x, W, b_s, b_m, bias="fixed", batch_first=True, chunk=8)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for B, T in ((2, 17), (3, 40)):
        x = torch.randn(B, T, dim, device="cuda", generator=g)
        results = []
        for fn in (compiled, f):
            xi = x.clone().requires_grad_()
            out, S, M = fn(xi, W, b_s, b_m)
            assert out.shape == (B, T, n)
            grads = torch.autograd.grad((out.square().sum() + S.sum() + M.sum()), (xi, W, b_s, b_m))
            results.append([out, S, M, *grads])
        names = ["out", "S", "M", "dx", "dW", "db_s", "db_m"]
        errs = {k: rel_err(_np(a), _np(b)) for k, a, b in zip(names, *results)}
        bad = {k: e for k, e in errs.items() if not e <= 1e-6}
        assert not bad, f"B={B} T={T}: compiled vs eager {bad}"
    assert counter.frame_count == 1


def _module_grads(module, fn, x, loss):
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    outs = fn(xi)
    loss(outs).backward()
    return outs, [xi.grad] + [p.grad for _, p in module.named_parameters()]


@pytest.mark.parametrize("bias", BIAS)
def test_compiled_nn_cell_bf16_fullgraph_matches_eager(bias):
    counter = _compile_counter()
    torch.manual_seed(0)
    cell = kspec.nn.E79Cell(64, 32, bias=bias, chunk=8).cuda()
    x = torch.randn(3, 29, 64, device="cuda", dtype=torch.bfloat16)

    def loss(outs):
        out, S, M = outs
        return out.float().square().sum() + S.sum() + M.sum()

    compiled = torch.compile(cell, backend=counter, fullgraph=True)
    got, got_grads = _module_grads(cell, lambda xi: compiled(xi, batch_first=True), x, loss)
    want, want_grads = _module_grads(cell, lambda xi: cell(xi, batch_first=True), x, loss)
    assert counter.frame_count == 1
    names = ["out", "S", "M", "dx"] + ["d" + k for k, _ in cell.named_parameters()]
    errs = {k: rel_err(_np(a), _np(b)) for k, a, b in zip(names, [*got, *got_grads], [*want, *want_grads])}
    bad = {k: e for k, e in errs.items() if not e <= 1e-3}
    assert not bad, f"{bias}: compiled vs eager {bad} (all: {errs})"


@pytest.mark.parametrize("use_conv", [False, True])
@pytest.mark.parametrize("bias", BIAS)
def test_compiled_layer_fullgraph_forward_backward_matches_eager(bias, use_conv):
    """kspec.nn.E79CoupledMatrix (in_proj, conv, silu, the cell, out_proj) as one graph, fp32; inductor
    fuses the torch parts its own way, hence 1e-4."""
    counter = _compile_counter()
    torch.manual_seed(0)
    layer = kspec.nn.E79CoupledMatrix(48, n_state=16, use_conv=use_conv, bias=bias, chunk=4).cuda()
    x = torch.randn(3, 21, 48, device="cuda")

    def loss(outs):
        y, (S, M) = outs
        return y.square().sum() + S.sum() + M.sum()

    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    (y, (S, M)), got_grads = _module_grads(layer, compiled, x, loss)
    (y_r, (S_r, M_r)), want_grads = _module_grads(layer, layer, x, loss)
    assert counter.frame_count == 1
    names = ["dx"] + ["d" + k for k, _ in layer.named_parameters()]
    errs = {"y": rel_err(_np(y), _np(y_r)), "S": rel_err(_np(S), _np(S_r)), "M": rel_err(_np(M), _np(M_r))}
    errs.update({k: rel_err(_np(a), _np(b)) for k, a, b in zip(names, got_grads, want_grads)})
    bad = {k: e for k, e in errs.items() if not e <= 1e-4}
    assert not bad, f"{bias} conv={use_conv}: compiled vs eager {bad} (all: {errs})"
