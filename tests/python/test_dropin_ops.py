"""kspec.ops drop-ins: selective_state_update with mamba_ssm's arguments (checked on the CPU with the step
kernel replaced by a torch twin, on a GPU with the kernel), selective_scan_fn's argument types, and the
one activation vocabulary (canonical names and aliases, the same problem in C++ and Python)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kspec  # noqa: E402
import kspec.ops  # noqa: E402
from helpers import load_reference  # noqa: E402

# ---- selective_state_update ----


def state_update_reference(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, idx=None):
    """mamba_ssm's selective_state_update in float64 from its documented semantics: returns (out, the new
    state); heads h read group h // (nheads / ngroups) of B and C; idx: the state rows of the batch."""
    f = lambda t: None if t is None else t.double()  # noqa: E731
    state, x, dt, A, B, C, D, z, dt_bias = map(f, (state, x, dt, A, B, C, D, z, dt_bias))
    heads = state.dim() == 4
    if not heads:
        state, x, dt, A = state[:, None], x[:, None], dt[:, None], A[None]
        D, z, dt_bias = (None if t is None else t[None] if t.dim() == 1 else t[:, None] for t in (D, z, dt_bias))
    B, C = (t[:, None] if t.dim() == 2 else t for t in (B, C))
    new = state.clone()
    rows = state[idx] if idx is not None else state
    nheads, ngroups = x.shape[1], B.shape[1]
    g = torch.arange(nheads) // (nheads // ngroups)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    s = torch.exp(dt[..., None] * A) * rows + (dt * x)[..., None] * B[:, g, None, :]
    out = (s * C[:, g, None, :]).sum(-1)
    if D is not None:
        out = out + D * x
    if z is not None:
        out = out * F.silu(z)
    if idx is not None:
        new[idx] = s
    else:
        new = s
    return (out, new) if heads else (out[:, 0], new[:, 0])


def _step_twin(state, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """kspec.ops.selective_scan_step's arithmetic in torch (fp32 state in place): the CPU stand-in for the
    kernel, so selective_state_update's reshaping, casts and write-back are tested without a GPU."""
    assert state.dtype == torch.float32 and state.is_contiguous() and A.dtype == torch.float32
    assert all(t is None or t.dtype == torch.float32 for t in (D, delta_bias)) and B.dim() == 3
    dt = delta.float() + (0 if delta_bias is None else delta_bias)
    dt = F.softplus(dt) if delta_softplus else dt
    g = torch.arange(u.shape[1]) // (u.shape[1] // B.shape[1])
    state.copy_(torch.exp(dt[..., None] * A) * state + (dt * u.float())[..., None] * B.float()[:, g])
    out = (state * C.float()[:, g]).sum(-1) + (0 if D is None else D * u.float())
    return (out * (1 if z is None else F.silu(z.float()))).to(u.dtype)


def make_update_args(batch=3, nheads=None, dim=8, dstate=4, ngroups=1, dtype=torch.float32, state_dtype=torch.float32,
                     rows=None, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hd = (dim,) if nheads is None else (nheads, dim)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(device, dt)  # noqa: E731
    state = r(rows or batch, *hd, dstate, dt=state_dtype)
    bc = (batch, dstate) if ngroups == 1 and nheads is None else (batch, ngroups, dstate)
    return dict(state=state, x=r(batch, *hd), dt=r(batch, *hd), A=-torch.rand(*hd, dstate, generator=g).to(device),
                B=r(*bc), C=r(*bc), D=r(*hd, dt=torch.float32), z=r(batch, *hd), dt_bias=r(*hd))


UPDATE_CASES = {
    "mamba1": dict(),
    "mamba1_bf16_state": dict(dtype=torch.bfloat16, state_dtype=torch.bfloat16),
    "heads_groups": dict(nheads=4, ngroups=2, dim=6),
    "heads_one_group": dict(nheads=3, dim=5),
    "indices": dict(rows=6),
}


def _run_update(args, softplus, idx, fn):
    args = dict(args)
    state = args.pop("state")
    out = fn(state, **args, dt_softplus=softplus, state_batch_indices=idx)
    return out, state


@pytest.mark.parametrize("case", list(UPDATE_CASES))
@pytest.mark.parametrize("softplus", [False, True])
def test_selective_state_update_semantics_with_a_torch_step(monkeypatch, case, softplus):
    monkeypatch.setattr(kspec.ops, "selective_scan_step", _step_twin)
    kw = UPDATE_CASES[case]
    args = make_update_args(**kw)
    idx = torch.tensor([4, 0, 2]) if kw.get("rows") else None
    want_out, want_state = state_update_reference(**args, dt_softplus=softplus, idx=idx)
    out, state = _run_update(args, softplus, idx, kspec.ops.selective_state_update)
    tol = 1e-5 if args["x"].dtype == torch.float32 else 2e-2
    assert out.shape == args["x"].shape and out.dtype == args["x"].dtype
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(state.double(), want_state, rtol=tol, atol=tol)  # updated in place


def test_selective_state_update_without_optional_inputs(monkeypatch):
    monkeypatch.setattr(kspec.ops, "selective_scan_step", _step_twin)
    args = make_update_args()
    for k in ("D", "z", "dt_bias"):
        args[k] = None
    want_out, want_state = state_update_reference(**args)
    out, state = _run_update(args, False, None, kspec.ops.selective_state_update)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(3, 7)), r"x must be \(3, 8\)"),
    (dict(A=torch.zeros(8, 5)), r"A must be \(8, 4\)"),
    (dict(B=torch.zeros(3, 3, 4)), "B must be .* ngroups dividing dim = 8"),
    (dict(dt_bias=torch.zeros(9)), r"dt_bias must be \(8,\)"),
    (dict(state=torch.zeros(3, 8)), "state must be"),
    (dict(state=torch.zeros(5, 8, 4)), "state has 5 rows for a batch of 3"),
])
def test_selective_state_update_names_bad_arguments(change, match):
    args = dict(make_update_args(), **change)
    with pytest.raises(ValueError, match=match):
        _run_update(args, True, None, kspec.ops.selective_state_update)


def test_selective_state_update_refuses_other_types():
    args = make_update_args()
    args["C"] = args["C"].numpy()
    with pytest.raises(TypeError, match="C is a numpy.ndarray but state is a torch.Tensor"):
        _run_update(args, True, None, kspec.ops.selective_state_update)
    args["C"] = [[0.0] * 4] * 3
    with pytest.raises(TypeError, match="C must be a torch tensor or a GPU array.*got list"):
        _run_update(args, True, None, kspec.ops.selective_state_update)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_gpu_selective_state_update_vs_reference(case):
    kw = UPDATE_CASES[case]
    # the GPU sizes, where the case does not set its own (the head cases set dim)
    sizes = dict(dict(batch=4 if not kw.get("rows") else 3, dstate=16, dim=64), **kw)
    args = make_update_args(**sizes, device="cuda")
    idx = torch.tensor([4, 0, 2], device="cuda") if kw.get("rows") else None
    want_out, want_state = state_update_reference(**{k: v.cpu() for k, v in args.items()}, dt_softplus=True,
                                                  idx=None if idx is None else idx.cpu())
    out, state = _run_update(args, True, idx, kspec.ops.selective_state_update)
    tol = 1e-4 if args["x"].dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(state.cpu().double(), want_state, rtol=tol, atol=tol)


# ---- selective_scan_fn's argument types ----

def _scan_args():
    u = np.zeros((2, 8, 50), np.float32)
    B = np.zeros((2, 4, 50), np.float32)
    return [u, u.copy(), -np.ones((8, 4), np.float32), B, B.copy()]


def test_selective_scan_fn_names_a_non_array():
    u, delta, A, B, C = _scan_args()
    with pytest.raises(TypeError, match="selective_scan_fn: B must be a torch tensor or a GPU array.*got list"):
        kspec.ops.selective_scan_fn(u, delta, A, B.tolist(), C)
    with pytest.raises(TypeError, match="delta_bias must be .* got float"):
        kspec.ops.selective_scan_fn(u, delta, A, B, C, delta_bias=0.5)


def test_selective_scan_fn_refuses_mixed_frameworks():
    u, delta, A, B, C = _scan_args()
    with pytest.raises(TypeError, match="B is a numpy.ndarray but u is a torch.Tensor"):
        kspec.ops.selective_scan_fn(torch.from_numpy(u), torch.from_numpy(delta), torch.from_numpy(A), B, C)


def test_selective_scan_fn_takes_other_arrays_to_the_registry():
    """A (batch, dstate, seqlen) B of another framework is reshaped without torch's methods (it failed at
    B.unsqueeze) and reaches the registry, whose check names the argument."""
    with pytest.raises(ValueError, match="selective_scan.fwd: input 'u': expected a CUDA tensor"):
        kspec.ops.selective_scan_fn(*_scan_args())


# ---- one activation vocabulary ----

def test_activation_vocabulary_is_one_for_every_op():
    assert kspec.ops.ACTIVATIONS == ("none", "relu", "silu", "gelu_tanh", "gelu_erf")
    for op, choices in (("norm_act.fwd", ["none", "silu", "gelu_tanh", "gelu_erf"]), ("norm_act.bwd", None),
                        ("gemm", ["none", "relu", "gelu_tanh"]), ("gemm.bwd", None)):
        act = next(p for p in kspec.op_info(op)["params"] if p["name"] == "act")
        assert act["aliases"] == kspec.ops.ACTIVATION_ALIASES and act["default"] == "none"
        assert set(act["choices"]) <= set(kspec.ops.ACTIVATIONS) and (choices is None or act["choices"] == choices)
    assert kspec.ops.canonical_act("identity") == kspec.ops.canonical_act(None) == "none"
    assert kspec.ops.canonical_act("gelu") == "gelu_tanh"
    with pytest.raises(ValueError, match=r"kspec.ops.linear: act must be one of none, relu, gelu_tanh, "
                                         r"'identity' \(= none\), 'gelu' \(= gelu_tanh\); got 'gelu_erf'"):
        kspec.ops.linear(torch.zeros(2, 3), torch.zeros(4, 3), act="gelu_erf")


@pytest.mark.parametrize("op, alias, canonical, dims", [
    ("norm_act.fwd", "identity", "none", {"hidden": 256}),
    ("norm_act.fwd", "gelu", "gelu_tanh", {"hidden": 256}),
])
def test_an_alias_compiles_the_canonical_specialization(op, alias, canonical, dims):
    first = kspec.compile(op, dtype="bf16", act=canonical, **dims)
    again = kspec.compile(op, dtype="bf16", act=alias, **dims)
    assert [r["key"] for r in again] == [r["key"] for r in first]
    assert all(r["source"] in ("memory", "disk") for r in again)


def test_references_take_both_spellings():
    na, gemm = load_reference("norm_act"), load_reference("gemm")
    x, w, b = np.random.default_rng(0).normal(size=(3, 8)), np.ones(8), np.zeros(8)
    for alias, canonical in kspec.ops.ACTIVATION_ALIASES.items():
        np.testing.assert_array_equal(na.norm_act_fwd(x, w, b, "layernorm", alias, 1e-5)[0],
                                      na.norm_act_fwd(x, w, b, "layernorm", canonical, 1e-5)[0])
    np.testing.assert_array_equal(gemm.gemm_fwd(x, x, None, "gelu")[0], gemm.gemm_fwd(x, x, None, "gelu_tanh")[0])
    assert not np.array_equal(gemm.gemm_fwd(x, x, None, "gelu")[0], gemm.gemm_fwd(x, x, None, "none")[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_aliases_run_the_same_kernels(dtype):
    x = torch.randn(64, 256, device="cuda", dtype=dtype)
    w, b = torch.randn(256, device="cuda", dtype=dtype), torch.randn(256, device="cuda", dtype=dtype)
    for alias, canonical in (("identity", "none"), ("gelu", "gelu_tanh")):
        assert torch.equal(kspec.ops.norm_act(x, w, b, act=alias), kspec.ops.norm_act(x, w, b, act=canonical))
    W = torch.randn(128, 256, device="cuda", dtype=dtype)
    y = kspec.ops.linear(x, W, None, "gelu")
    assert torch.equal(y, kspec.ops.linear(x, W, None, "gelu_tanh"))
    want = F.gelu(x.double() @ W.double().T, approximate="tanh")
    assert ((y.double() - want).norm() / want.norm()).item() <= (1e-3 if dtype == torch.float32 else 2e-2)
    assert torch.equal(kspec.ops.gemm(x, W, None, act="identity")[0], kspec.ops.gemm(x, W, None, act="none")[0])
