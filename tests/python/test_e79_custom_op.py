"""The E79 custom ops (kspec::e79_fwd, kspec::e79_bwd) without a GPU.

Registered with their schemas and an autograd formula; their fake kernels give the real outputs'
shapes, dtypes and strides (batch-first layouts, checkpoints only when saved) under FakeTensorMode,
and autograd through them gives every gradient. Then the kernels are stood in for by the float64
reference on CPU (kspec._e79.call swapped for `reference_call`, which also checks that the
checkpoints reaching the backward are the forward's, and the ops' own implementations registered for
CPU tensors): torch.library.opcheck passes, and torch.compile(fullgraph=True) traces
kspec.ops.e79_cell into one graph of the custom ops (with checkpoints only when a gradient is wanted,
with dynamic shapes too), whose outputs and gradients equal the eager autograd Function's and the
float64 reference's. What the CUDA kernels compute is tested on the GPU (test_gpu_e79.py), which runs
`check_compiled_cell` below with the real kernels and inductor.
"""
import numpy as np
import pytest

from helpers import TOL, rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _e79  # noqa: E402
from kspec.reference import e79 as ref  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

BIAS = ["none", "fixed", "input"]
OPS = (torch.ops.kspec.e79_fwd, torch.ops.kspec.e79_bwd)


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


def _name(d):
    return str(d).split(".")[1]


def make_inputs(T, B, n, bias, dtype, device, batch_first=False, init=True, bias_dtype=None, seed=0):
    """kvqm (T, B, 4n or 6n; batch-first storage seen as (T, B, C) with batch_first), b_s, b_m (fixed
    biases, in bias_dtype or kvqm's), S0, M0 (fp32 or None): leaves that require grad."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dt)

    C = (6 if bias == "input" else 4) * n
    store = rn(B, T, C) if batch_first else rn(T, B, C)
    store.requires_grad_()
    kvqm = store.transpose(0, 1) if batch_first else store
    bdt = bias_dtype or dtype
    b_s = rn(n, scale=0.5, dt=bdt).requires_grad_() if bias == "fixed" else None
    b_m = rn(n, scale=0.5, dt=bdt).requires_grad_() if bias == "fixed" else None
    S0 = rn(B, n, n, scale=0.3, dt=torch.float32).requires_grad_() if init else None
    M0 = rn(B, n, n, scale=0.3, dt=torch.float32).requires_grad_() if init else None
    return dict(store=store, kvqm=kvqm, b_s=b_s, b_m=b_m, S0=S0, M0=M0)


def _leaves(inp):
    return [t for t in (inp["store"], inp["b_s"], inp["b_m"], inp["S0"], inp["M0"]) if t is not None]


def _run(fn, inp, n, bias, chunk, seed=1):
    """(out, S, M) of fn(kvqm, b_s, b_m, S0, M0) and the gradients of every leaf for random dout, dS,
    dM; the leaves are fresh copies, so eager and compiled runs see the same inputs."""
    leaves = {k: (None if t is None else t.detach().clone().requires_grad_()) for k, t in inp.items()
              if k != "kvqm"}
    kvqm = leaves["store"].transpose(0, 1) if inp["kvqm"] is not inp["store"] else leaves["store"]
    out, S, M = fn(kvqm, leaves["b_s"], leaves["b_m"], leaves["S0"], leaves["M0"])
    g = torch.Generator().manual_seed(seed)
    cots = [torch.randn(t.shape, generator=g).to(device=t.device, dtype=t.dtype) for t in (out, S, M)]
    wrt = [t for t in leaves.values() if t is not None]
    grads = torch.autograd.grad((out, S, M), wrt, cots)
    return (out, S, M), grads, cots


def check_compiled_cell(bias, dtype, device, batch_first, backend, tol, T=13, B=3, n=16, chunk=4,
                        bias_dtype=None, init=True):
    """kspec.ops.e79_cell under torch.compile(fullgraph=True, backend) against the eager call (the
    autograd Function): one frame, outputs and every gradient (kvqm in its layout, fixed biases, S0,
    M0) within `tol`; then against the float64 reference within the dtype's tolerance (x4, as the
    GPU tests of the cell)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    inp = make_inputs(T, B, n, bias, dtype, device, batch_first, init, bias_dtype)

    def cell(kvqm, b_s, b_m, S0, M0):
        return kspec.ops.e79_cell(kvqm, n, b_s, b_m, S0, M0, bias=bias, chunk=chunk)

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(cell, backend=counter, fullgraph=True)
    got, got_grads, cots = _run(compiled, inp, n, bias, chunk)
    want, want_grads, _ = _run(cell, inp, n, bias, chunk)
    assert counter.frame_count == 1
    assert got[0].stride() == want[0].stride(), "out's layout"
    assert got_grads[0].stride() == want_grads[0].stride(), "dkvqm's layout"
    errs = {name: rel_err(_np(a), _np(b)) for name, a, b in zip(("out", "S", "M"), got, want)}
    errs.update({f"d{i}": rel_err(_np(a), _np(b)) for i, (a, b) in enumerate(zip(got_grads, want_grads))})
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"compiled vs eager, {bias} {dtype} batch_first={batch_first}: {bad}"

    # Both against float64: the gradient blocks of kvqm, the fixed biases' and the states' gradients.
    a = _np(inp["kvqm"])
    blocks = [a[..., j * n:(j + 1) * n] for j in range(6 if bias == "input" else 4)]
    bs, bm = (blocks[4], blocks[5]) if bias == "input" else (_np(inp["b_s"]), _np(inp["b_m"]))
    out_r, S_r, M_r = ref.e79_fwd(*blocks[:4], bs, bm, _np(inp["S0"]), _np(inp["M0"]))
    dout, dS, dM = (_np(c) for c in cots)
    gr = ref.e79_bwd(dout, *blocks[:4], bs, bm, _np(inp["S0"]), _np(inp["M0"]), dS=dS, dM=dM)
    dstore = _np(got_grads[0])
    dkvqm = dstore.transpose(1, 0, 2) if batch_first else dstore
    names = ["dk", "dv", "dq", "dm"] + (["db_s", "db_m"] if bias == "input" else [])
    errs = {"out": rel_err(_np(got[0]), out_r), "S": rel_err(_np(got[1]), S_r), "M": rel_err(_np(got[2]), M_r)}
    errs.update({k: rel_err(dkvqm[..., j * n:(j + 1) * n], gr[k]) for j, k in enumerate(names)})
    rest = (["db_s", "db_m"] if bias == "fixed" else []) + (["dS0", "dM0"] if init else [])
    errs.update({k: rel_err(_np(g), gr[k]) for k, g in zip(rest, got_grads[1:])})
    bad = {k: e for k, e in errs.items() if not e <= 4 * TOL[_name(dtype)]}
    assert not bad, f"compiled vs float64, {bias} {dtype} batch_first={batch_first}: {bad}"
    return counter


# ---- registration and fake kernels ----

def test_ops_are_registered_with_their_schemas():
    fwd, bwd = (str(op.default._schema) for op in OPS)
    assert fwd == ("kspec::e79_fwd(Tensor kvqm, Tensor? b_s, Tensor? b_m, Tensor? S0, Tensor? M0, SymInt n, str mode, "
                   "SymInt chunk, str? config, bool save) -> (Tensor, Tensor, Tensor, Tensor)")
    assert bwd == ("kspec::e79_bwd(Tensor? dout, Tensor kvqm, Tensor? b_s, Tensor? b_m, Tensor? S0, Tensor? M0, "
                   "Tensor chk, Tensor? dS, Tensor? dM, SymInt n, str mode, SymInt chunk, str? config) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    for name in ("kspec::e79_fwd", "kspec::e79_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", BIAS)
def test_fake_kernels_give_the_real_layouts(bias, batch_first, save):
    T, B, n, chunk = 37, 5, 32, 8
    with FakeTensorMode():
        inp = make_inputs(T, B, n, bias, torch.bfloat16, "cuda", batch_first, bias_dtype=torch.float32)
        kvqm, b_s, b_m, S0, M0 = (inp[k] for k in ("kvqm", "b_s", "b_m", "S0", "M0"))
        out, S, M, chk = torch.ops.kspec.e79_fwd(kvqm, b_s, b_m, S0, M0, n, bias, chunk, None, save)
        C = kvqm.shape[-1]
        assert out.shape == (T, B, n) and out.dtype == torch.bfloat16 and out.device == kvqm.device
        # out and dkvqm keep kvqm's order of the (T, B) dims: batch-first memory stays batch-first
        assert out.stride() == ((n, T * n, 1) if batch_first else (B * n, n, 1))
        assert S.shape == M.shape == (B, n, n) and S.dtype == M.dtype == torch.float32
        if save:
            assert chk.shape == (B, 5, 2, n, n) and chk.dtype == torch.float32  # ceil(37 / 8) checkpoints
        else:
            assert chk.numel() == 0
        dout = torch.empty((T, B, n), dtype=torch.bfloat16, device="cuda")
        dkvqm, dbs, dbm, dS0, dM0 = torch.ops.kspec.e79_bwd(dout, kvqm, b_s, b_m, S0, M0, chk, None, None, n, bias,
                                                              chunk, None)
        assert dkvqm.shape == (T, B, C) and dkvqm.dtype == torch.bfloat16
        assert dkvqm.stride() == ((C, T * C, 1) if batch_first else (B * C, C, 1))
        if bias == "fixed":  # fp32 biases on a bf16 projection: fp32 gradients
            assert dbs.shape == dbm.shape == (n,) and dbs.dtype == dbm.dtype == torch.float32
        else:  # none, or per-step biases whose gradients are dkvqm's last two blocks
            assert dbs.numel() == dbm.numel() == 0
        assert dS0.shape == dM0.shape == (B, n, n) and dS0.dtype == torch.float32


def test_fake_autograd_gives_every_gradient():
    T, B, n = 9, 3, 16
    with FakeTensorMode():  # CPU fakes: the autograd engine would look for a CUDA device for CUDA ones
        inp = make_inputs(T, B, n, "fixed", torch.float32, "cpu", batch_first=True)
        kvqm, b_s, b_m, S0, M0 = (inp[k] for k in ("kvqm", "b_s", "b_m", "S0", "M0"))
        out, S, M, chk = torch.ops.kspec.e79_fwd(kvqm, b_s, b_m, S0, M0, n, "fixed", 4, None, True)
        assert out.requires_grad and S.requires_grad and not chk.requires_grad
        leaves = _leaves(inp)
        grads = torch.autograd.grad(out.sum() + S.sum(), leaves)
        for g, leaf in zip(grads, leaves):
            assert g.shape == leaf.shape and g.dtype == leaf.dtype
        out, S, M, chk = torch.ops.kspec.e79_fwd(kvqm, b_s, b_m, S0, M0, n, "fixed", 4, None, False)
        with pytest.raises(RuntimeError, match="save=False"):
            torch.autograd.grad(out.sum(), leaves)


# ---- the float64 reference standing in for the kernels, on CPU ----

def _checkpoints(k, v, q, m, bs, bm, S0, M0, chunk):
    """(S, M) before steps 0, chunk, 2 chunk, ...: [B, nchk, 2, n, n]."""
    T = k.shape[0]
    per_step = bs is not None and bs.ndim == 3
    states = []
    for t in range(0, T, chunk):
        cut = (lambda a: a[:t]) if per_step else (lambda a: a)
        _, S, M = ref.e79_fwd(k[:t], v[:t], q[:t], m[:t], None if bs is None else cut(bs),
                              None if bm is None else cut(bm), S0, M0)
        states.append(np.stack([S, M], axis=1))
    return np.stack(states, axis=1)


def reference_call(op, *inputs, chunk, config=None, out):
    """kspec.call for e79.fwd / e79.bwd with preallocated outputs, by the float64 reference."""
    a = [_np(t) for t in inputs]
    if op == "e79.fwd":
        k, v, q, m, bs, bm, S0, M0 = a
        for t, r in zip(out[:3], ref.e79_fwd(k, v, q, m, bs, bm, S0, M0)):
            t.copy_(torch.from_numpy(r))
        if out[3] is not None:
            out[3].copy_(torch.from_numpy(_checkpoints(k, v, q, m, bs, bm, S0, M0, chunk)))
        return out
    assert op == "e79.bwd", op
    dout, k, v, q, m, bs, bm, S0, M0, chk, dS, dM = a
    # the backward reads the forward's checkpoints: they must arrive intact
    want = _checkpoints(k, v, q, m, bs, bm, S0, M0, chunk)
    assert chk.shape == want.shape and rel_err(chk, want) <= 1e-6, "checkpoints"
    grads = ref.e79_bwd(dout, k, v, q, m, bs, bm, S0, M0, dS=dS, dM=dM)
    for t, key in zip(out, ref.GRAD_KEYS):
        if t is not None:
            t.copy_(torch.from_numpy(grads[key]))
    return out


@pytest.fixture
def reference_kernels(monkeypatch):
    """The ops' implementations, registered for CPU tensors, with the float64 reference as kspec.call."""
    monkeypatch.setattr(_e79, "call", reference_call)
    _e79.e79_fwd.register_kernel("cpu", _e79.cell.fwd_kernel)
    _e79.e79_bwd.register_kernel("cpu", _e79.cell.bwd_kernel)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _op_args(bias, batch_first, save=True, T=7, B=2, n=8, chunk=3):
    inp = make_inputs(T, B, n, bias, torch.float32, "cpu", batch_first)
    return inp, (inp["kvqm"], inp["b_s"], inp["b_m"], inp["S0"], inp["M0"], n, bias, chunk, None, save)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", BIAS)
def test_opcheck_forward_and_backward(reference_kernels, bias, batch_first):
    inp, args = _op_args(bias, batch_first)
    torch.library.opcheck(torch.ops.kspec.e79_fwd.default, args)
    with torch.no_grad():
        chk = torch.ops.kspec.e79_fwd(*args)[3]
    dout = torch.randn(args[0].shape[:2] + (args[5],))
    bwd_args = (dout, *(t.detach() if t is not None else None for t in args[:5]), chk,
                torch.randn(args[3].shape), None, *args[5:9])
    torch.library.opcheck(torch.ops.kspec.e79_bwd.default, bwd_args)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", BIAS)
def test_compiled_cell_is_one_graph_matching_eager(reference_kernels, bias, batch_first):
    check_compiled_cell(bias, torch.float32, "cpu", batch_first, "aot_eager", tol=1e-6)


def test_compiled_cell_through_inductor(reference_kernels):
    check_compiled_cell("input", torch.float32, "cpu", True, "inductor", tol=1e-6)


def test_compiled_cell_bf16_with_fp32_biases_and_no_initial_state(reference_kernels):
    check_compiled_cell("fixed", torch.bfloat16, "cpu", True, "aot_eager", tol=1e-6, bias_dtype=torch.float32,
                        init=False)


def _graph_calls(gm, name):
    return [node for node in gm.graph.nodes if node.op == "call_function" and name in str(node.target)]


def test_compiled_graphs_hold_the_custom_ops_and_save_only_for_a_gradient(reference_kernels):
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    n = 8
    fw, bw = [], []

    def record(into):
        def compiler(gm, example_inputs):
            into.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=record(fw), bw_compiler=record(bw))
    cell = torch.compile(lambda kvqm, b_s, b_m: kspec.ops.e79_cell(kvqm, n, b_s, b_m, chunk=3),
                         backend=backend, fullgraph=True)
    inp = make_inputs(7, 2, n, "fixed", torch.float32, "cpu", init=False)
    with torch.no_grad():
        cell(inp["kvqm"], inp["b_s"], inp["b_m"])
    (call,) = _graph_calls(fw[-1], "kspec.e79_fwd")
    assert call.args[-1] is False  # save: no checkpoints without a gradient
    out, S, M = cell(inp["kvqm"], inp["b_s"], inp["b_m"])
    (call,) = _graph_calls(fw[-1], "kspec.e79_fwd")
    assert call.args[-1] is True
    (out + 0).sum().backward()  # only out: the backward gets no dS, dM (None, not zeros)
    (call,) = _graph_calls(bw[-1], "kspec.e79_bwd")
    assert inp["store"].grad is not None and inp["b_s"].grad is not None
    assert len(fw) == 2 and len(bw) == 1


def test_compiled_with_dynamic_shapes_is_one_graph(reference_kernels):
    """dynamic=True: n from a weight's shape (as kspec.ops.e79 takes it), other T and B: no recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def cell(kvqm, W, b_s, b_m):
        n = W.shape[0] // 4
        return kspec.ops.e79_cell(kvqm, n, b_s, b_m, chunk=4)

    compiled = torch.compile(cell, backend=counter, fullgraph=True, dynamic=True)
    for T, B in ((9, 3), (14, 2)):
        inp = make_inputs(T, B, 8, "fixed", torch.float32, "cpu", batch_first=True, init=False)
        W = torch.empty(32, 5)
        out, S, M = compiled(inp["kvqm"], W, inp["b_s"], inp["b_m"])
        (out.sum() + M.sum()).backward()
        assert out.shape == (T, B, 8) and out.stride() == (8, T * 8, 1)
        out_r, S_r, _ = ref.e79_fwd(*(_np(inp["kvqm"])[..., j * 8:(j + 1) * 8] for j in range(4)),
                                    _np(inp["b_s"]), _np(inp["b_m"]))
        assert rel_err(_np(out), out_r) <= 1e-6 and rel_err(_np(S), S_r) <= 1e-6
        assert inp["store"].grad is not None and torch.isfinite(inp["store"].grad).all()
    assert counter.frame_count == 1


def test_projection_backward_fake_allocates_like_the_real_one():
    """kspec::linear_bwd (the projection's backward in kspec.ops.e79) allocates dx and dW contiguous
    whatever the strides of x and W; its fake must say so, or inductor's stride assertion fails on
    E79CoupledMatrix with a conv (x: silu of the conv's transposed output)."""
    with FakeTensorMode():
        x = torch.empty(3, 48, 21, device="cuda").transpose(1, 2)
        W = torch.empty(48, 64, device="cuda").t()
        dy = torch.empty(3, 21, 64, device="cuda")
        dx, dW, db = torch.ops.kspec.linear_bwd(dy, x, W, dy.new_empty(0), False, "none", False)
        assert dx.shape == x.shape and dx.is_contiguous()
        assert dW.shape == W.shape and dW.is_contiguous() and db.numel() == 0
