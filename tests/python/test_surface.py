"""The generated torch surface (kspec._surface) without a GPU.

Every registered forward/backward pair has a family spec; each family's custom ops carry the schema the
spec declares; their fake kernels give C++ infer_outputs' shapes and dtypes for every case of the op
(CUDA fake tensors), with symbolic sizes kept symbolic under make_fx's symbolic tracing. Then norm_act's
kernels are stood in for by the float64 reference on CPU: opcheck passes on both generated ops, and the
eager path (the generated autograd.Function), the custom op's autograd and torch.compile(fullgraph=True,
dynamic=True) give the same outputs and gradients, one frame for two shapes. The GPU twin with the real
kernels for every family is test_gpu_surface.py."""
import numpy as np
import pytest

from helpers import case_inputs, inferred_outputs, rel_err, tensor_descs

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _C, _difflogic, _e79, _mhc, _mlstm, _surface, _torch  # noqa: E402,F401  (importing registers)
from kspec.reference import norm_act as ref  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

DEFAULT_FAKE = ["norm_act", "selective_scan"]  # fakes evaluated from the schema (the others: their own rule)


# Registered backward ops whose family has no torch surface yet (C++ and kspec.call only), and the issue
# that adds it. The test below fails when one of them gets a surface (take it off) or a new one appears.
NO_SURFACE_YET = {
    # kspec.nn.DiffLogicCA.rollout calls it from its own autograd Function (T steps backward), not as a family.
    "difflogic.ca.step.bwd": "issue 30",
}

# The families after norm_act, selective_scan, linear and e79 (issues 29, 30, 34).
NEW_FAMILIES = ["group_sum", "logic_layer", "mhc_post", "mhc_post_pre", "mhc_pre", "mhc_pre_only", "mhc_sinkhorn", "mlstm_chunkwise",
                "mlstm_parallel"]
ALL_FAMILIES = sorted(["e79", "linear", "norm_act", "selective_scan"] + NEW_FAMILIES)


def test_every_backward_op_has_a_family():
    """A registry op `X.bwd` is a differentiable family: its forward (X.fwd or X) and it have a spec."""
    pairs = {s.family.ops for s in _surface.FAMILIES.values()}
    ops = set(_C.list_ops())
    want = set()
    for op in ops:
        if op.endswith(".bwd") and op not in NO_SURFACE_YET:
            base = op[:-len(".bwd")]
            want.add((base + ".fwd" if base + ".fwd" in ops else base, op))
    assert want and want <= pairs, want - pairs
    surfaced = {bwd for _, bwd in pairs}
    for op in NO_SURFACE_YET:
        assert op not in surfaced, f"{op} has a torch surface now: take it off NO_SURFACE_YET"
    assert sorted(_surface.FAMILIES) == ALL_FAMILIES


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_custom_ops_carry_the_spec_schema(name):
    s = _surface.FAMILIES[name]
    f = s.family
    for op, args, outs in ((s.fwd_op, f.fwd, f.fwd_out), (s.bwd_op, f.bwd, f.bwd_out)):
        schema = str(op._opoverload._schema)
        assert schema.startswith(f"kspec::{name}_") and f"({args})" in schema
        assert schema.endswith(" -> " + _surface._returns(len(outs)))  # one output: a Tensor, not a tuple
        qual = f"kspec::{op._name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kspec::{name}_fwd", "Autograd")


def _fake_inputs(info, case, device="cuda"):
    got = case_inputs(info, case)
    if got is None:
        return None
    shapes, dtypes = got
    return [None if sh is None else torch.empty(sh, dtype=getattr(torch, dt), device=device)
            for sh, dt in zip(shapes, dtypes)]


def _got(outs):
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in outs]


def _params(s, case, which):
    """The custom op's non-tensor arguments from a case's params (a flag the op has not: True)."""
    args = s.fwd_args if which == "fwd" else s.bwd_args
    return [case["params"].get(n, True) for n, t in args if not _surface._is_tensor(t)]


def _cases(op):
    return [c for c in _C.op_info(op)["cases"] if not c["large"]]


@pytest.mark.parametrize("name", DEFAULT_FAKE)
def test_schema_fakes_match_infer_outputs_on_every_case(name):
    """The generated fakes (kspec._schema over the OpDef) against C++ infer_outputs, forward and backward,
    every case; an output C++ leaves absent is an empty stand-in; selective_scan's states (kept for the
    backward) have ceil(seqlen / 16) steps."""
    s = _surface.FAMILIES[name]
    checked = 0
    for which, op, custom in (("fwd", s.family.ops[0], s.fwd_op), ("bwd", s.family.ops[1], s.bwd_op)):
        info = _C.op_info(op)
        for case in _cases(op):
            with FakeTensorMode(allow_non_fake_inputs=False):
                tensors = _fake_inputs(info, case)
                if tensors is None:
                    continue
                outs = custom(*tensors, *_params(s, case, which))
            want = inferred_outputs(op, [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
                                         for t in tensors], case["params"])
            for o, w, d in zip(outs, want, info["outputs"]):
                assert o.device.type == "cuda"
                if w is not None:
                    assert _got([o]) == [w], (op, case["name"], d["name"])
                elif d["name"] == "states":
                    b, dim, seqlen = tensors[0].shape
                    assert tuple(o.shape) == (b, dim, -(-seqlen // 16), tensors[2].shape[1]), case["name"]
                else:
                    assert o.numel() == 0, (op, case["name"], d["name"])
            checked += 1
    assert checked >= 8, checked


def test_linear_fake_matches_gemm_on_every_case():
    s = _surface.FAMILIES["linear"]
    info = _C.op_info("gemm")
    checked = 0
    for case in _cases("gemm"):
        with FakeTensorMode():
            tensors = _fake_inputs(info, case)
            if tensors is None or tensors[1].numel() != tensors[1].shape[-2] * tensors[1].shape[-1]:
                continue  # linear's weight is one matrix: no batched weights
            p = case["params"]
            w = tensors[1].reshape(tensors[1].shape[-2:])
            y, pre = s.fwd_op(tensors[0], w, tensors[2], p.get("act", "none"), bool(p.get("tf32", False)))
        want = inferred_outputs("gemm", [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
                                         for t in tensors], p)
        assert _got([y]) == [want[0]], case["name"]
        assert pre.numel() == 0 or _got([pre]) == [want[0]]
        checked += 1
    assert checked >= 4, checked


def test_e79_fake_matches_infer_outputs_on_every_case():
    s = _surface.FAMILIES["e79"]
    info = _C.op_info("e79.fwd")
    checked = 0
    for case in _cases("e79.fwd"):
        with FakeTensorMode():
            k, v, q, m, b_s, b_m, S0, M0 = tensors = _fake_inputs(info, case)
            n = k.shape[-1]
            mode = "input" if b_s is not None and b_s.dim() == 3 else "fixed" if b_s is not None else "none"
            blocks = [k, v, q, m] + ([b_s, b_m] if mode == "input" else [])
            kvqm = torch.cat(blocks, dim=-1)
            fixed = mode == "fixed"
            chunk = case["params"].get("chunk", 16)
            out, S, M, chk = s.fwd_op(kvqm, b_s if fixed else None, b_m if fixed else None, S0, M0, n, mode,
                                      chunk, None, True)
        want = inferred_outputs("e79.fwd", [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
                                            for t in tensors], case["params"])
        assert _got([out, S, M]) == want[:3], case["name"]
        T, B = k.shape[:2]
        assert tuple(chk.shape) == (B, -(-T // chunk), 2, n, n), case["name"]
        checked += 1
    assert checked >= 4, checked


def test_fakes_keep_symbolic_sizes():
    """make_fx's symbolic tracing (what torch.compile's dynamic shapes run): the generated fakes return
    sizes that are expressions of the inputs' symbols, not the example's numbers."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.empty(3, 5, 40), torch.empty(40)
    gm = make_fx(lambda x, w: torch.ops.kspec.norm_act_fwd(x, w, None, "rmsnorm", "silu", 1e-5),
                 tracing_mode="symbolic")(x, w)
    y, mean, rstd = [v for v in gm.graph.nodes if v.op == "call_function"][0].meta["val"]
    assert all(isinstance(d, torch.SymInt) for d in y.shape) and len(mean.shape) == 2
    assert [int(d) for d in y.shape] == [3, 5, 40] and str(mean.shape[0]) == str(y.shape[0])

    u = torch.empty(2, 8, 37)
    A, B, C, D = torch.empty(8, 4), torch.empty(2, 1, 4, 37), torch.empty(2, 1, 4, 37), torch.empty(8)
    gm = make_fx(lambda u, A, B, C, D: torch.ops.kspec.selective_scan_fwd(u, u, A, B, C, D, None, None, None, True,
                                                                          True), tracing_mode="symbolic")(u, A, B, C, D)
    out, last, states = [v for v in gm.graph.nodes if v.op == "call_function"][0].meta["val"]
    steps = states.shape[2]
    assert isinstance(steps, torch.SymInt) and steps.node.expr.free_symbols and int(steps) == 3  # ceil(37 / 16)
    assert str(states.shape[0]) == str(out.shape[0]) and str(last.shape[2]) == str(states.shape[3])


# ---- norm_act with the float64 reference standing in for its kernels, on CPU ----

def _reference_call(op, *inputs, norm, act, eps, save_stats=True, out=None):
    a = [None if t is None else t.detach().double().numpy() for t in inputs]
    like = inputs[0]
    if op == "norm_act.fwd":
        x, w, b = a
        y, mean, rstd = ref.norm_act_fwd(x, w, b, norm, act, eps)
        if not save_stats:  # as C++: mean and rstd are not outputs then
            return torch.from_numpy(y).to(like.dtype), None, None
        return (torch.from_numpy(y).to(like.dtype), torch.from_numpy(mean).float(), torch.from_numpy(rstd).float())
    assert op == "norm_act.bwd", op
    dy, x, w, b, _mean, _rstd = a
    dx, dw, db = ref.norm_act_bwd(dy, x, w, b, norm, act, eps)
    w_t = inputs[2]
    return (torch.from_numpy(dx).to(like.dtype), torch.from_numpy(dw).to(w_t.dtype),
            None if db is None else torch.from_numpy(db).to(w_t.dtype))


@pytest.fixture
def reference_norm_act(monkeypatch):
    monkeypatch.setattr(_torch, "call", _reference_call)
    monkeypatch.setattr(_surface, "call", _reference_call)  # the default forward's one call
    monkeypatch.setattr(_torch.norm_act, "grad_call", None)  # call_grad runs the registry ops, not the stand-in
    _torch.norm_act.fwd_op.register_kernel("cpu", _torch.norm_act.fwd_kernel)
    _torch.norm_act.bwd_op.register_kernel("cpu", _torch.norm_act.bwd_kernel)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_generated_ops(reference_norm_act, bias):
    x = torch.randn(4, 3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, dtype=torch.float64, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.kspec.norm_act_fwd.default, (x, w, b, "layernorm", "gelu_tanh", 1e-5))
    with torch.no_grad():
        _, mean, rstd = torch.ops.kspec.norm_act_fwd(x, w, b, "layernorm", "gelu_tanh", 1e-5)
    dy = torch.randn(4, 3, 16, dtype=torch.float64)
    args = (dy, x.detach(), w.detach(), None if b is None else b.detach(), mean, rstd, "layernorm", "gelu_tanh", 1e-5)
    torch.library.opcheck(torch.ops.kspec.norm_act_bwd.default, args)


def _run(fn, x, w, b, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = fn(*leaves) if b is not None else fn(*leaves, None)
    grads = torch.autograd.grad(y, leaves, dy)
    return y, grads


def test_eager_custom_op_and_compiled_agree(reference_norm_act):
    """The three doors of one family (eager Function, the custom op's autograd, torch.compile with dynamic
    shapes) give the float64 reference's outputs and gradients; two shapes of one rank: one frame."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def public(x, w, b):
        return kspec.ops.norm_act(x, w, b, norm="rmsnorm", act="silu")

    def custom(x, w, b):
        return torch.ops.kspec.norm_act_fwd(x, w, b, "rmsnorm", "silu", 1e-5)[0]

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(public, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for rows, hidden in ((6, 32), (9, 48)):
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(2, rows, hidden, generator=g, dtype=torch.float64)
        w, b = torch.randn(hidden, generator=g, dtype=torch.float64), torch.randn(hidden, generator=g,
                                                                                  dtype=torch.float64)
        dy = torch.randn(2, rows, hidden, generator=g, dtype=torch.float64)
        y_ref = ref.norm_act_fwd(x.numpy(), w.numpy(), b.numpy(), "rmsnorm", "silu", 1e-5)[0]
        g_ref = ref.norm_act_bwd(dy.numpy(), x.numpy(), w.numpy(), b.numpy(), "rmsnorm", "silu", 1e-5)
        for fn in (public, custom, compiled):
            y, grads = _run(fn, x, w, b, dy)
            assert rel_err(y.detach().numpy(), y_ref) < 1e-12
            for got, want in zip(grads, g_ref):
                assert rel_err(got.numpy(), want) < 1e-12
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0], frames  # the second shape: no recompile


def test_eager_paths_record_only_what_is_needed(reference_norm_act):
    """No gradient wanted: the forward alone (no autograd node); wanted: the generated Function, whose
    backward reads the saved statistics."""
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    y = kspec.ops.norm_act(x, w)
    assert y.grad_fn is None
    x.requires_grad_()
    y = kspec.ops.norm_act(x, w)
    assert y.grad_fn.name() == "NormActBackward"  # the Function's node, or the torch extension's C++ one
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert np.isfinite(dx.numpy()).all()


def test_norm_act_keeps_statistics_only_for_a_backward(reference_norm_act, monkeypatch):
    """norm_act.fwd's mean and rstd are outputs only where a backward reads them (save_stats): the
    no-grad path asks for y alone, the grad path for all three; the custom op with save_stats=False
    returns empty stand-ins, as its fake does."""
    seen = []

    def spy(op, *inputs, **kw):
        seen.append((op, kw.get("save_stats", True)))
        return _reference_call(op, *inputs, **kw)

    monkeypatch.setattr(_torch, "call", spy)
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    kspec.ops.norm_act(x, w, norm="rmsnorm")
    assert seen == [("norm_act.fwd", False)]
    y = kspec.ops.norm_act(x.requires_grad_(), w, norm="rmsnorm")
    y.sum().backward()
    assert seen[1:] == [("norm_act.fwd", True), ("norm_act.bwd", True)]
    torch.library.opcheck(torch.ops.kspec.norm_act_fwd.default, (x.detach(), w, None, "layernorm", "none", 1e-5, False))
    y, mean, rstd = torch.ops.kspec.norm_act_fwd(x.detach(), w, None, "layernorm", "none", 1e-5, False)
    assert y.shape == x.shape and mean.numel() == 0 and rstd.numel() == 0


def test_schema_outputs_follow_a_bool_param():
    """An output whose present_with is a bool param (norm_act.fwd's mean, rstd: save_stats) follows the
    param as given, else its default, as C++ infer_outputs does."""
    from kspec import _schema

    shapes, dtypes = [(4, 16), (16,), None], ["float32", "float32", None]
    assert _schema.output_specs("norm_act.fwd", shapes, dtypes) == [
        ("float32", (4, 16)), ("float32", (4,)), ("float32", (4,))]
    assert _schema.output_specs("norm_act.fwd", shapes, dtypes, params={"save_stats": False}) == [
        ("float32", (4, 16)), None, None]
    descs = tensor_descs([torch.empty(4, 16), torch.empty(16), None])
    assert [s is not None for s in _C.infer_outputs("norm_act.fwd", descs, {"save_stats": False})] == [True, False, False]
