"""kspec.ops: the functional API, one function per op family. With torch tensors these go through
torch.library custom ops (autograd and torch.compile work); with other frameworks they call the
registry directly (forward only)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from ._core import call
from ._tensors import describe, empty, framework_of
from ._typing import Array, Arrays

if TYPE_CHECKING:
    from ._core import Explanation

# kspec._torch, which sets this when it is imported (kspec's own import does, where torch is): the torch
# entries below read a global per call instead of running an import statement (importlib's fast path,
# ~0.4 µs a call on the helper machine). _torch_glue() where it is not set yet.
_torch = None


def _torch_glue():
    import kspec._torch as glue  # fromlist-free: `from . import` runs importlib's Python per call

    return glue


_mhc = None  # kspec._mhc, set when it is imported (as _torch above): a decode step calls mhc_pre per layer


def _mhc_glue():
    import kspec._mhc as glue

    return glue


_NORMS = ("layernorm", "rmsnorm")
# One activation vocabulary for every op with an `act` (api/ops/common/activations.h, where the C++ ops
# map an alias to its canonical name): canonical none, relu, silu, gelu_tanh, gelu_erf; "identity" is
# accepted for none and "gelu" for gelu_tanh (the tanh approximation, as in cuBLASLt's epilogue; torch's
# default F.gelu is gelu_erf). norm_act takes none, silu, gelu_tanh, gelu_erf; gemm/linear none, relu,
# gelu_tanh.
ACTIVATIONS = ("none", "relu", "silu", "gelu_tanh", "gelu_erf")
ACTIVATION_ALIASES = {"identity": "none", "gelu": "gelu_tanh"}
_ACTS = ("none", "silu", "gelu_tanh", "gelu_erf")
_GEMM_ACTS = ("none", "relu", "gelu_tanh")


def canonical_act(act: str, allowed: Sequence[str] = ACTIVATIONS, who: str = "kspec") -> str:
    """The canonical name of activation `act` (an alias mapped, see ACTIVATIONS); ValueError when it is
    not one of `allowed` (None counts as "none")."""
    name = "none" if act is None else ACTIVATION_ALIASES.get(act, act) if isinstance(act, str) else act
    if name not in allowed:
        spelled = ", ".join(allowed) + "".join(f", {a!r} (= {c})" for a, c in ACTIVATION_ALIASES.items()
                                               if c in allowed)
        raise ValueError(f"{who}: act must be one of {spelled}; got {act!r}")
    return name


def _is_torch(x) -> bool:
    # By the type's bases, without importing torch or reading sys.modules: torch.compile traces this
    # function, and its tracer failed iterating sys.modules while other modules were being imported.
    t = type(x)
    if t.__name__ == "Tensor" and t.__module__ == "torch":  # torch.Tensor itself: no generator frames
        return True
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in t.__mro__)


def norm_act(x: Array, weight: Array, bias: Array | None = None, *, norm: str = "layernorm", act: str = "none",
             eps: float = 1e-5) -> Array:
    """Fused normalization + affine + activation over the last dim.

    y = act(norm(x) * weight + bias), norm in {layernorm, rmsnorm}, act in {none, silu, gelu_tanh,
    gelu_erf} (or an alias: ACTIVATIONS); statistics and arithmetic in fp32.

    x: (..., hidden) fp32/fp16/bf16, last dim contiguous; weight: (hidden) like x or fp32;
    bias: (hidden) like weight, or None. Returns y: (..., hidden) like x. Differentiable for torch
    tensors (dx, dweight, dbias from kspec's backward kernel)."""
    if _is_torch(x):
        act = act if act in _ACTS else canonical_act(act, _ACTS, "kspec.ops.norm_act")
        return (_torch or _torch_glue()).norm_act(x, weight, bias, norm, act, float(eps), True)
    return call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=float(eps), save_stats=False)[0]


def norm_act_fwd(x: Array, weight: Array, bias: Array | None = None, *, norm: str = "layernorm", act: str = "none",
                 eps: float = 1e-5) -> Arrays:
    """The raw forward op. Returns (y: (..., hidden), mean: (...) fp32, rstd: (...) fp32)."""
    return call("norm_act.fwd", x, weight, bias, norm=norm, act=act, eps=float(eps))


def norm_act_bwd(dy: Array, x: Array, weight: Array, bias: Array, mean: Array, rstd: Array, *, norm: str = "layernorm",
                 act: str = "none", eps: float = 1e-5) -> Arrays:
    """The raw backward op. dy, x: (..., hidden); mean, rstd from norm_act_fwd.
    Returns (dx: (..., hidden), dweight: (hidden), dbias: (hidden) or None)."""
    return call("norm_act.bwd", dy, x, weight, bias, mean, rstd, norm=norm, act=act, eps=float(eps))


def _is_array(x) -> bool:
    """Whether kspec.call can read x (kspec._tensors.describe): a torch tensor, or an array with
    __cuda_array_interface__ or __dlpack__ and a shape."""
    return _is_torch(x) or ((hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"))
                            and hasattr(x, "ndim"))


def _check_arrays(who: str, **tensors):
    """TypeError unless every given tensor is an array kspec reads, all torch or none torch (the first,
    required one says which); None stands for an absent optional tensor."""
    first = next(iter(tensors))
    torch_first = _is_torch(tensors[first])
    for name, t in tensors.items():
        if t is None:
            continue
        is_torch = _is_torch(t)
        if not (is_torch or _is_array(t)):
            raise TypeError(f"{who}: {name} must be a torch tensor or a GPU array (CuPy, __cuda_array_interface__, "
                            f"DLPack), got {type(t).__name__}")
        if is_torch != torch_first:
            raise TypeError(f"{who}: {name} is a {type(t).__module__}.{type(t).__name__} but {first} is a "
                            f"{type(tensors[first]).__module__}.{type(tensors[first]).__name__}: pass one framework's "
                            "tensors")


def _contiguous(x):
    if x is None or not hasattr(x, "is_contiguous") or x.is_contiguous():
        return x
    return x.contiguous()


def selective_scan_fn(u: Array, delta: Array, A: Array, B: Array, C: Array, D: Array | None = None,
                      z: Array | None = None, delta_bias: Array | None = None, delta_softplus: bool = False,
                      return_last_state: bool = False, h0: Array | None = None,
                      save_states: bool = True) -> Array | tuple[Array, Array]:
    """The Mamba selective scan, with mamba_ssm's selective_scan_fn arguments (plus h0).

    For channel d, step t, state n (dt = delta + delta_bias, softplus'ed if delta_softplus):
        x_t[n] = exp(dt_t A[d, n]) x_{t-1}[n] + dt_t B_t[n] u_t,  x_{-1} = h0 (or 0)
        out_t  = (sum_n C_t[n] x_t[n] + D[d] u_t) * silu(z_t)
    u, delta, z: (batch, dim, seqlen) fp32/fp16/bf16; A: (dim, dstate) fp32, dstate <= 256;
    B, C: (dim, dstate) fixed, (batch, dstate, seqlen) or (batch, groups, dstate, seqlen) variable, the
    dtype of u or fp32; D, delta_bias: (dim,) fp32; h0: (batch, dim, dstate) fp32.
    Returns out (batch, dim, seqlen) like u, and with return_last_state also last_state
    (batch, dim, dstate) fp32. Differentiable for torch tensors (all inputs, h0 included).

    When a gradient is wanted the forward keeps the state entering every 16th step for the backward
    (batch * dim * ceil(seqlen / 16) * dstate * 4 bytes: twice a bf16 u at dstate 16), which then skips
    recomputing the forward; save_states=False keeps none, and the backward recomputes them.
    Other frameworks' GPU arrays (CuPy, __cuda_array_interface__, DLPack) run the forward alone; anything
    else, or torch mixed with another framework, is a TypeError naming the argument."""
    tensors = (u, delta, A, B, C, D, z, delta_bias, h0)
    # torch tensors (the common case: u's type or a subclass, nn.Parameter) need no _check_arrays: its
    # keyword dict and two type tests per tensor cost more than the rest of this wrapper
    tensor_type = type(u)
    same = _is_torch(u)
    is_torch = same
    if same:
        for t in tensors:
            if t is not None and not isinstance(t, tensor_type):
                same = False
                break
    if not same:
        _check_arrays("kspec.ops.selective_scan_fn", u=u, delta=delta, A=A, B=B, C=C, D=D, z=z,
                      delta_bias=delta_bias, h0=h0)
    if B.ndim == 3:
        B = B[:, None]
    if C.ndim == 3:
        C = C[:, None]
    if is_torch:  # u is (and, past _check_arrays, so is every tensor)
        args = [t if t is None or t.is_contiguous() else t.contiguous()
                for t in (u, delta, A, B, C, D, z, delta_bias, h0)]
        out, last = (_torch or _torch_glue()).selective_scan(*args, bool(delta_softplus), bool(save_states))
    else:
        args = [_contiguous(t) for t in (u, delta, A, B, C, D, z, delta_bias, h0)]
        out, last, _ = call("selective_scan.fwd", *args, delta_softplus=bool(delta_softplus))
    return (out, last) if return_last_state else out


def selective_scan_step(state: Array, u: Array, delta: Array, A: Array, B: Array, C: Array, D: Array | None = None,
                        z: Array | None = None, delta_bias: Array | None = None, delta_softplus: bool = False) -> Array:
    """One decode step of the scan, updating `state` in place; returns out.

    state: (batch, dim, dstate) fp32, contiguous (updated in place); u, delta, z: (batch, dim);
    A: (dim, dstate) fp32; B, C: (batch, dstate) or (batch, groups, dstate) for this step, the dtype of
    u or fp32 (a fixed (dim, dstate) B or C: kspec.call("selective_scan.step", ...) with a 2-D tensor);
    D, delta_bias: (dim,) fp32. out: (batch, dim) like u. Not differentiable."""
    if B.ndim == 2:
        B = B[:, None]
    if C.ndim == 2:
        C = C[:, None]
    u, delta, A, B, C, D, z, delta_bias = (_contiguous(t) for t in (u, delta, A, B, C, D, z, delta_bias))
    descs = [describe(t) for t in (u,)]
    out = empty(framework_of([u]), descs[0][1], tuple(u.shape), descs[0][4])
    call("selective_scan.step", state, u, delta, A, B, C, D, z, delta_bias, delta_softplus=bool(delta_softplus),
         out=(out, state))
    return out


def selective_state_update(state: Array, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None = None,
                           z: Array | None = None, dt_bias: Array | None = None, dt_softplus: bool = False,
                           state_batch_indices: Array | None = None) -> Array:
    """One decode step of the selective scan, updating `state` in place, with mamba_ssm's arguments
    (mamba_ssm.ops.triton.selective_state_update); torch tensors.

        dt' = dt + dt_bias (softplus'ed if dt_softplus)
        state = exp(dt' A) state + dt' B x;   out = (sum_n C state + D x) * silu(z)

    state: (batch, dim, dstate), or (batch, nheads, dim, dstate) with heads (Mamba-2's layout: head h
    reads group h // (nheads / ngroups) of B and C); any float dtype (other than contiguous fp32 it is
    updated through an fp32 copy, written back); x, dt, z: (batch, dim) or (batch, nheads, dim);
    A: (dim, dstate) or (nheads, dim, dstate); B, C: (batch, dstate) or (batch, ngroups, dstate);
    D, dt_bias: (dim,) or (nheads, dim). state_batch_indices: (batch,) ints or None: the row of `state`
    each sequence of x reads and writes. Returns out: like x. The arithmetic is kspec's
    selective_scan.step (fp32 state, A, D, dt_bias). Not differentiable."""
    _check_arrays("kspec.ops.selective_state_update", state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
                  dt_bias=dt_bias, state_batch_indices=state_batch_indices)
    if not _is_torch(state):
        raise TypeError("kspec.ops.selective_state_update: takes torch tensors (other frameworks: "
                        "kspec.ops.selective_scan_step)")
    import torch

    heads = state.dim() == 4
    if state.dim() not in (3, 4):
        raise ValueError(f"kspec.ops.selective_state_update: state must be (batch, dim, dstate) or "
                         f"(batch, nheads, dim, dstate), got {tuple(state.shape)}")
    rows = state.shape[0]
    hd = state.shape[1:-1]  # (dim,) or (nheads, dim)
    channels, dstate = hd.numel(), state.shape[-1]
    batch = x.shape[0]

    def per_channel(name, t, lead):
        """t (lead..., *hd) -> (lead..., channels); a shape error names t."""
        if t is None:
            return None
        if tuple(t.shape) != (*lead, *hd):
            raise ValueError(f"kspec.ops.selective_state_update: {name} must be {(*lead, *hd)} for a state of "
                             f"shape {tuple(state.shape)}, got {tuple(t.shape)}")
        return t.reshape(*lead, channels)

    x2 = per_channel("x", x, (batch,))
    dt2 = per_channel("dt", dt, (batch,)).to(x.dtype)
    z2 = None if z is None else per_channel("z", z, (batch,)).to(x.dtype)
    D2 = None if D is None else per_channel("D", D, ()).float()
    bias2 = None if dt_bias is None else per_channel("dt_bias", dt_bias, ()).float()
    if tuple(A.shape) != (*hd, dstate):
        raise ValueError(f"kspec.ops.selective_state_update: A must be {(*hd, dstate)}, got {tuple(A.shape)}")
    A2 = A.reshape(channels, dstate).float()
    BC = []
    for name, t in (("B", B), ("C", C)):
        if t.dim() == 2:
            t = t[:, None]
        if t.dim() != 3 or t.shape[0] != batch or t.shape[2] != dstate or hd[0] % t.shape[1] != 0:
            raise ValueError(f"kspec.ops.selective_state_update: {name} must be (batch, dstate) or (batch, ngroups, "
                             f"dstate) with ngroups dividing {'nheads' if heads else 'dim'} = {hd[0]}, batch = "
                             f"{batch}, dstate = {dstate}; got {tuple(t.shape)}")
        BC.append(t if t.dtype in (x.dtype, torch.float32) else t.to(x.dtype))
    if state_batch_indices is None:
        if rows != batch:
            raise ValueError(f"kspec.ops.selective_state_update: state has {rows} rows for a batch of {batch} "
                             "(state_batch_indices picks the rows)")
        direct = state.dtype == torch.float32 and state.is_contiguous()
        work = state.view(batch, channels, dstate) if direct else state.reshape(batch, channels, dstate).float()
    else:
        idx = state_batch_indices.long()
        direct = False
        work = state[idx].reshape(batch, channels, dstate).float()
    out = selective_scan_step(work, x2, dt2, A2, BC[0], BC[1], D2, z2, bias2, delta_softplus=bool(dt_softplus))
    if not direct:
        back = work.view(batch, *hd, dstate).to(state.dtype)
        if state_batch_indices is None:
            state.copy_(back)
        else:
            state[idx] = back
    return out.view(x.shape)


def gemm(x: Array, weight: Array, bias: Array | None = None, *, act: str = "none", tf32: bool = False,
         save_pre: bool = False) -> Arrays:
    """The raw cuBLASLt op: y = act(x @ weight^T + bias), fp32 accumulation.

    x: (..., m, k) fp32/fp16/bf16, any view with one unit-stride dim among the last two (transposed views
    are read in place); weight: (n, k), or (..., n, k) with x's batch dims; bias: (n) or None;
    act: "none", "relu" or "gelu_tanh" (cuBLASLt's epilogue; "gelu" is accepted for it); tf32: fp32 inputs
    on TF32 tensor cores. Returns (y: (..., m, n), pre: (..., m, n) or None); pre (the pre-activation, for
    gemm_bwd) is written only with save_pre=True and act="gelu_tanh" (n a multiple of 8)."""
    if not save_pre:
        return call("gemm", x, weight, bias, act=act, tf32=bool(tf32))
    from ._tensors import empty, framework_of
    from ._core import _C, describe

    specs = _C.infer_outputs("gemm", [describe(t) for t in (x, weight, bias)], {"act": act, "tf32": bool(tf32)})
    fw = framework_of((x,))
    device = describe(x)[4]
    y = empty(fw, specs[0][0], specs[0][1], device)
    pre = empty(fw, specs[0][0], specs[0][1], device)
    return call("gemm", x, weight, bias, act=act, tf32=bool(tf32), out=(y, pre))


def gemm_bwd(dy: Array, x: Array, weight: Array, saved: Array | None = None, *, act: str = "none", tf32: bool = False,
             bias_grad: bool = True) -> Arrays:
    """The raw backward: dpre = dy * act'(saved); returns (dx like x, dweight like weight, dbias (n) or None).
    saved: gelu_tanh: the forward's pre; relu: its pre or y; none: None."""
    from ._tensors import empty, framework_of
    from ._core import _C, describe

    descs = [describe(t) for t in (dy, x, weight, saved)]
    specs = _C.infer_outputs("gemm.bwd", descs, {"act": act, "tf32": bool(tf32)})
    fw = framework_of((dy,))
    device = descs[0][4]
    dx = empty(fw, specs[0][0], specs[0][1], device)
    dw = empty(fw, specs[1][0], specs[1][1], device)
    db = empty(fw, descs[0][1], (descs[0][2][-1],), device) if bias_grad else None
    return call("gemm.bwd", dy, x, weight, saved, act=act, tf32=bool(tf32), out=(dx, dw, db))


def gemm_reads_in_place(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the gemm op reads a (..., rows, cols) operand with these strides (in elements) in place:
    api/ops/gemm/op.cpp's matrix_of and gemm/layout.h's rule. The dims before the last two collapse into
    one batch stride (size-1 dims may have any), and one of the last two is unit-stride with the other's
    stride at least its size (a row-major or column-major matrix; a size-1 dim may have any stride).
    kspec.ops.linear copies an operand that fails it (as F.linear would read it: x[:, ::2], a broadcast
    row); the raw gemm op refuses it."""
    shape, strides = tuple(shape), tuple(strides)
    if len(shape) < 2:
        return len(shape) == 1 and (shape[0] <= 1 or strides[0] == 1)
    expected = None
    for d, st in zip(reversed(shape[:-2]), reversed(strides[:-2])):
        if d == 1:
            continue
        if expected is not None and st != expected:
            return False
        expected = st * d
    rows, cols = shape[-2:]
    rs, cs = strides[-2:]
    if (cs == 1 or cols <= 1) and (rows <= 1 or rs >= max(cols, 1)):
        return True
    return (rs == 1 or rows <= 1) and (cols <= 1 or cs >= max(rows, 1))


def linear_copies(x: Array, weight: Array, bias: Array | None = None) -> list:
    """The operands kspec.ops.linear copies before cuBLASLt reads them: [(name, shape, strides)], empty
    when every one is read in place (a 1-d x counts as one row; the bias must be unit-stride)."""
    out = []
    xs, xst = tuple(x.shape), tuple(x.stride())
    if len(xs) == 1:
        xs, xst = (1,) + xs, (xs[0],) + xst
    if not gemm_reads_in_place(xs, xst):
        out.append(("x", tuple(x.shape), tuple(x.stride())))
    if not gemm_reads_in_place(tuple(weight.shape), tuple(weight.stride())):
        out.append(("weight", tuple(weight.shape), tuple(weight.stride())))
    if bias is not None and not gemm_reads_in_place(tuple(bias.shape), tuple(bias.stride())):
        out.append(("bias", tuple(bias.shape), tuple(bias.stride())))
    return out


def linear(x: Array, weight: Array, bias: Array | None = None, act: str = "none", *, tf32: bool = False) -> Array:
    """y = act(x @ weight^T + bias) like torch.nn.functional.linear (+ activation), through cuBLASLt with
    the bias and activation in the GEMM's epilogue (GELU with a small K: the plain GEMM, then kspec's
    kernel, where that is faster).

    x: (..., in_features), any view F.linear takes: transposed and sliced views are read in place, others
    (a step-2 last dim, a broadcast row) copied first (kspec.explain("linear", x, weight, bias) names
    them); weight: (out_features, in_features); bias: (out_features) or None; act: "none", "relu" or
    "gelu_tanh" ("gelu" is accepted for it). Differentiable for torch tensors (gemm.bwd; dx comes back
    with x's shape and strides as autograd gives them)."""
    act = act if act in _GEMM_ACTS else canonical_act(act, _GEMM_ACTS, "kspec.ops.linear")
    if _is_torch(x):
        return (_torch or _torch_glue()).linear(x, weight, bias, act, bool(tf32))
    return call("gemm", x, weight, bias, act=act, tf32=bool(tf32))[0]


def explain_linear(x: Array, weight: Array, bias: Array | None = None, act: str = "none", *,
                   tf32: bool = False) -> Explanation:
    """kspec.explain for kspec.ops.linear (also kspec.explain("linear", x, weight, bias, act=...)): the gemm
    call it makes, plus a line per operand it copies first; `.copies` lists them as (name, shape, strides)."""
    from ._core import Explanation, explain

    copies = linear_copies(x, weight, bias)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    x, weight, bias = (t.contiguous() if t is not None and any(c[0] == n for c in copies) else t
                       for n, t in (("x", x), ("weight", weight), ("bias", bias)))
    info = dict(explain("gemm", x, weight, bias, act=act, tf32=bool(tf32)).info)
    lines = [f"linear: copies {n} {list(shape)} with strides {list(st)} to a contiguous tensor first (cuBLASLt "
             "cannot read that view in place)" for n, shape, st in copies]
    info["text"] = info["text"] + "".join("\n" + line for line in (lines or ["linear: no copies (every operand "
                                                                              "read in place)"]))
    info["copies"] = copies
    return Explanation(info)


def e79_cell(kvqm: Array, n: int, b_s: Array | None = None, b_m: Array | None = None, S0: Array | None = None,
             M0: Array | None = None, *, bias: str = "fixed", chunk: int = 16,
             config: str | None = None) -> tuple[Array, Array, Array]:
    """The E79 coupled memory-modulation cell on a fused projection (states and arithmetic in fp32).

    kvqm: (T, B, 4n) columns [k | v | q | m], or (T, B, 6n) [k | v | q | m | b_s | b_m] with
    bias="input"; fp32/fp16/bf16, any strides with unit stride along the last dim (a batch-first
    (B, T, C) tensor passes as its transpose(0, 1) without a copy). b_s, b_m: (n,) with bias="fixed"
    (dtype of kvqm or fp32), else None. S0, M0: (B, n, n) fp32 or None (zeros).
    Returns (out (T, B, n) like kvqm, S (B, n, n) fp32, M (B, n, n) fp32). Differentiable for torch
    tensors: the forward keeps (S, M) every `chunk` steps (kspec.ops.e79_checkpoint_bytes_per_token)
    and the backward recomputes each segment once. config: a tuning config forced on e79.fwd and e79.bwd
    alike, e.g. "split=16,cluster=4" (one thread-block cluster of 4 CTAs per sequence, sm_90+); None:
    the tuned or heuristic one. torch.compile traces it without a graph break, as the custom ops
    kspec::e79_fwd and kspec::e79_bwd (checkpoints kept only where a gradient is wanted)."""
    import kspec._e79 as _e79  # fromlist-free: `from . import` runs importlib's Python per call

    if bias not in _e79.BIAS_MODES:
        raise ValueError(f"kspec.ops.e79_cell: bias must be one of {_e79.BIAS_MODES}, got {bias!r}")
    cols = 6 if bias == "input" else 4
    if kvqm.dim() != 3 or kvqm.shape[-1] != cols * n:
        raise ValueError(f"kspec.ops.e79_cell: kvqm must be (T, B, {cols}n) = (T, B, {cols * n}) for n = {n} and "
                         f"bias={bias!r}, got {tuple(kvqm.shape)}")
    if bias == "fixed" and (b_s is None or b_m is None):
        raise ValueError("kspec.ops.e79_cell: bias='fixed' needs b_s and b_m of shape (n,)")
    if bias != "fixed":
        b_s = b_m = None
    if not _is_torch(kvqm):  # forward only, any framework; biases and states as the op takes them
        blocks = [kvqm[..., j * n:(j + 1) * n] for j in range(cols)]
        bs, bm = (blocks[4], blocks[5]) if bias == "input" else (b_s, b_m)
        out, S, M, _ = call("e79.fwd", *blocks[:4], bs, bm, S0, M0, chunk=int(chunk), config=config)
        return out, S, M
    return _e79.cell_torch(kvqm, b_s, b_m, S0, M0, int(n), bias, int(chunk), config)


def e79(x: Array, W_kvqm: Array, b_s: Array | None = None, b_m: Array | None = None, W_bs: Array | None = None,
        W_bm: Array | None = None, S0: Array | None = None, M0: Array | None = None, *, bias: str = "fixed",
        batch_first: bool = False, chunk: int = 16, config: str | None = None) -> tuple[Array, Array, Array]:
    """E79 on inputs: one fused GEMM through kspec's gemm op (x @ [W_kvqm; W_bs; W_bm]^T, nn.Linear
    layout), then the cell (kspec.ops.e79_cell). Differentiable (x, every weight and bias, S0, M0).

    x: (T, B, dim), or (B, T, dim) with batch_first=True (no copies either way); W_kvqm: (4n, dim) rows
    [k | v | q | m], the dtype of x; b_s, b_m: (n,) for bias="fixed"; W_bs, W_bm: (n, dim) for
    bias="input"; S0, M0: (B, n, n) or None; config: as kspec.ops.e79_cell's. Returns (out (T, B, n) or
    (B, T, n), S, M (B, n, n) fp32). Under torch.compile: two custom ops (kspec::linear_fwd, kspec::e79_fwd)
    and their backwards, one graph (fullgraph=True works)."""
    import kspec._e79 as _e79  # fromlist-free: `from . import` runs importlib's Python per call

    if bias not in _e79.BIAS_MODES:
        raise ValueError(f"kspec.ops.e79: bias must be one of {_e79.BIAS_MODES}, got {bias!r}")
    if not _is_torch(x):
        raise TypeError("kspec.ops.e79: x must be a torch tensor (the raw ops take any framework: kspec.call)")
    if x.dim() != 3:
        raise ValueError(f"kspec.ops.e79: x must be (T, B, dim) or batch-first (B, T, dim), got {tuple(x.shape)}")
    if W_kvqm.dim() != 2 or W_kvqm.shape[0] % 4 != 0:
        raise ValueError(f"kspec.ops.e79: W_kvqm must be (4n, dim), got {tuple(W_kvqm.shape)}")
    n = W_kvqm.shape[0] // 4
    W = W_kvqm
    if bias == "input":
        if W_bs is None or W_bm is None:
            raise ValueError("kspec.ops.e79: bias='input' needs W_bs and W_bm of shape (n, dim)")
        import torch

        W = torch.cat([W_kvqm, W_bs, W_bm], dim=0)
    proj = linear(x, W)
    kvqm = proj.transpose(0, 1) if batch_first else proj
    out, S, M = e79_cell(kvqm, n, b_s, b_m, S0, M0, bias=bias, chunk=chunk, config=config)
    return (out.transpose(0, 1) if batch_first else out), S, M


def e79_checkpoint_bytes_per_token(n: int, chunk: int = 16) -> float:
    """Bytes E79's forward keeps per token and sequence for the backward besides its inputs: (S, M) in
    fp32 every `chunk` steps, 8 n^2 / chunk (n = 64, chunk = 16: 2048 bytes)."""
    return 8.0 * n * n / chunk


# ---- mlstm (issue 29): torch tensors only, named as in mlstm_kernels ----

def mlstm_chunkwise(q: Array, k: Array, v: Array, i: Array, f: Array, c_initial: Array | None = None,
                    n_initial: Array | None = None, m_initial: Array | None = None, return_last_states: bool = False,
                    eps: float = 1e-6, chunk_size: int = 128) -> Array | tuple[Array, tuple[Array, Array, Array]]:
    """The xLSTM mLSTM cell chunk by chunk (the recurrence exactly, any seqlen), as mlstm_kernels'
    mlstm_chunkwise__xl_chunk: a = logsigmoid(f), m' = max(a + m, i), C' = e^(a+m-m') C + e^(i-m') k v^T,
    n' alike, h = (s q)^T C' / (max(|s q.n'|, e^-m') + eps), s = DHQK^-1/2.

    q, k: (B, NH, S, DHQK), v: (B, NH, S, DHHV) fp32/fp16/bf16; i, f: (B, NH, S) gate pre-activations (q's
    dtype or fp32); c_initial (B, NH, DHQK, DHHV), n_initial (B, NH, DHQK), m_initial (B, NH, 1) fp32, all
    three or none (zeros). chunk_size: 16, 32, 64, 128 or 256 (256 with fp16/bf16 q, k, v only). Returns h
    (B, NH, S, DHHV) like q, or with return_last_states (h, (C, n, m)). Differentiable (kspec's backward: dq, dk, dv, di, df and dc_initial; n and m held constant as in
    mlstm_kernels, so n_initial, m_initial and the returned n, m carry no gradient; a gradient on the returned
    C reaches df, unlike mlstm_kernels). torch.compile: the custom ops kspec::mlstm_chunkwise_fwd/_bwd."""
    from . import _mlstm

    return _mlstm.mlstm_chunkwise(q, k, v, i, f, c_initial, n_initial, m_initial, return_last_states, eps,
                                  chunk_size)


def mlstm_parallel(q: Array, k: Array, v: Array, i: Array, f: Array, eps: float = 1e-6) -> Array:
    """The mLSTM's parallel form (no states): F = cumsum(logsigmoid(f)), D_ts = F_t - F_s + i_s (s <= t),
    m_t = max_s D_ts, C_ts = s q_t.k_s e^(D_ts - m_t), h = C V / (max(|sum_s C_ts|, e^-m_t) + eps).
    Shapes as mlstm_chunkwise; returns h. Differentiable (kspec::mlstm_parallel_fwd/_bwd)."""
    from . import _mlstm

    return _mlstm.mlstm_parallel(q, k, v, i, f, eps)


def mlstm(q: Array, k: Array, v: Array, i: Array, f: Array, c_initial: Array | None = None,
          n_initial: Array | None = None, m_initial: Array | None = None, return_last_states: bool = False,
          eps: float = 1e-6, chunk_size: int = 128,
          kernel: str = "chunkwise") -> Array | tuple[Array, tuple[Array, Array, Array]]:
    """mlstm_chunkwise (kernel="chunkwise") or mlstm_parallel (kernel="parallel": no initial or last
    states), one entry for both forms; see their docs."""
    if kernel == "parallel":
        if c_initial is not None or n_initial is not None or m_initial is not None or return_last_states:
            raise ValueError("kspec.ops.mlstm: kernel='parallel' has no states (no c/n/m_initial, no "
                             "return_last_states): use kernel='chunkwise'")
        return mlstm_parallel(q, k, v, i, f, eps)
    if kernel != "chunkwise":
        raise ValueError(f"kspec.ops.mlstm: kernel must be 'chunkwise' or 'parallel', got {kernel!r}")
    return mlstm_chunkwise(q, k, v, i, f, c_initial, n_initial, m_initial, return_last_states, eps, chunk_size)


def mlstm_step(q: Array, k: Array, v: Array, i: Array, f: Array, c: Array, n: Array, m: Array, eps: float = 1e-6,
               inplace: bool = False) -> tuple[Array, tuple[Array, Array, Array]]:
    """One decoding step (mlstm.step): q, k (B, NH, DHQK), v (B, NH, DHHV); i, f (B, NH, 1) or (B, NH);
    c (B, NH, DHQK, DHHV), n (B, NH, DHQK), m (B, NH, 1) fp32. Returns (h (B, NH, DHHV) like q, (c', n', m'));
    inplace=True writes c', n', m' into c, n, m (and returns them). Not differentiable."""
    from . import _mlstm

    return _mlstm.mlstm_step(q, k, v, i, f, c, n, m, eps, inplace)


# ---- mhc (issue 34): torch tensors only ----

def mhc_pre(x: Array, phi: Array, alpha: Array, bias: Array, gamma: Array | None = None, *, pre_only: bool = False,
            eps_rms: float = 1e-6, eps_pre: float = 1e-6, eps_sk: float = 1e-6, t_max: int = 20) -> tuple[Array, ...]:
    """mHC pre per token, fp32 math: v = vec(x), inv = 1/sqrt(mean(v^2) + eps_rms), h = inv alpha_s (v*gamma)
    phi^T + bias; H_pre = sigmoid(h[:n]) + eps_pre, H_post = 2 sigmoid(h[n:2n]), R = Sinkhorn-Knopp of h[2n:]
    (t_max steps), y = sum_i H_pre[i] x[i].

    x: (..., n, D) fp32/fp16/bf16, last dim contiguous; phi: (n*n + 2n, n*D) fp32 (pre_only: (n, n*D));
    alpha: (3,) fp32 (pre_only: (1,)); bias: (M,) fp32; gamma: (n*D,) fp32 or None. Returns (y (..., D) like x,
    h_pre (..., n), h_post (..., n), r (..., n, n)) fp32 — pre_only: (y, h_pre). Differentiable in every
    input (kspec::mhc_pre_fwd/_bwd; kspec::mhc_pre_only_* for the final collapse of the streams)."""
    glue = _mhc or _mhc_glue()
    if pre_only:
        return glue.run_pre_only(x, phi, alpha, bias, gamma, float(eps_rms), float(eps_pre))
    return glue.run_pre(x, phi, alpha, bias, gamma, float(eps_rms), float(eps_pre), float(eps_sk), int(t_max))


def mhc_post(x: Array, f: Array, h_post: Array, h_res: Array) -> Array:
    """mHC post: out[k] = h_post[k] f + sum_j h_res[j, k] x[j], the next layer's streams.
    x: (..., n, D); f: (..., D) like x; h_post: (..., n), h_res: (..., n, n) fp32 (mhc_pre's h_post and r).
    Returns out (..., n, D) like x. Differentiable (kspec::mhc_post_fwd/_bwd)."""
    return (_mhc or _mhc_glue()).run_post(x, f, h_post, h_res)


def mhc_post_pre(x: Array, f: Array, h_post: Array, h_res: Array, phi: Array, alpha: Array, bias: Array,
                 gamma: Array | None = None, *, eps_rms: float = 1e-6, eps_pre: float = 1e-6, eps_sk: float = 1e-6,
                 t_max: int = 20) -> tuple[Array, ...]:
    """Layer l's mhc_post fused with layer l + 1's mhc_pre: x_next = mhc_post(x, f, h_post, h_res) is written
    once and projected on chip, so the n streams are read once less than post then pre (537 MB at T 16384,
    n 4, D 4096 bf16). x, f, h_post, h_res as mhc_post's; phi, alpha, bias, gamma and the eps/t_max as
    mhc_pre's (layer l + 1's). Returns (x_next (..., n, D) like x, y (..., D) like x, h_pre, h_post, r) of
    layer l + 1. Differentiable in every input (kspec::mhc_post_pre_fwd/_bwd; the backward runs
    mhc.pre.bwd's kernels then mhc.post.bwd's)."""
    return (_mhc or _mhc_glue()).run_post_pre(x, f, h_post, h_res, phi, alpha, bias, gamma, float(eps_rms),
                                              float(eps_pre), float(eps_sk), int(t_max))


def mhc_sinkhorn(logits: Array, *, eps_sk: float = 1e-6, t_max: int = 20) -> Array:
    """Sinkhorn-Knopp of (..., n, n) fp32 logits: A = softmax over k + eps, A /= (sum_j A + eps), then t_max - 1
    times A /= (sum_k A + eps), A /= (sum_j A + eps). Returns R like logits; differentiable (the exact
    gradient of the t_max steps, iterates recomputed)."""
    from . import _mhc

    return _mhc.sinkhorn(logits, float(eps_sk), int(t_max))


def mhc_layer(x: Array, sublayer: Callable[[Array], Array], phi: Array, alpha: Array, bias: Array,
              gamma: Array | None = None, *, eps_rms: float = 1e-6, eps_pre: float = 1e-6, eps_sk: float = 1e-6,
              t_max: int = 20) -> Array:
    """One mHC-wrapped sublayer: y, H_pre, H_post, R = mhc_pre(x, ...); f = sublayer(y); returns
    mhc_post(x, f, H_post, R) (..., n, D). Differentiable through both ops and the sublayer."""
    y, _, h_post, r = mhc_pre(x, phi, alpha, bias, gamma, eps_rms=eps_rms, eps_pre=eps_pre, eps_sk=eps_sk,
                              t_max=t_max)
    return mhc_post(x, sublayer(y), h_post, r)


def mhc_expand(x: Array, n: int) -> Array:
    """x (..., D) -> (..., n, D): the n residual streams of mHC, each a copy of x (contiguous)."""
    from . import _mhc

    return _mhc.expand(x, n)


# ---- difflogic (issue 30): torch tensors only ----

def logic_layer(x: Array, logits: Array, a: Array, b: Array, *, mode: str = "soft", grad_factor: float = 1.0,
                consumers: tuple | None = None, row_major: str = "auto") -> Array:
    """A differentiable logic gate layer: y[:, g] = sum_i p_i op_i(x[:, a_g], x[:, b_g]) over the 16 two-input
    ops (multilinear extensions), p = softmax(logits[g]) (mode="soft") or the one-hot argmax, ties to the
    lower index (mode="hard"; its gradient is the straight-through estimator's: the soft backward).

    x: (batch, n_in) fp32/fp16/bf16; logits: (n_out, 16) fp32; a, b: (n_out,) integer wires in [0, n_in)
    (a gate may read one input twice). Returns y (batch, n_out) like x. Differentiable in x and logits
    (dx scaled by grad_factor; no atomics: the same bits every run). consumers: the wiring's CSR
    (kspec._difflogic.consumers) when the caller caches it; None builds it (and checks the wires) per call.
    Layout: a feature-major x (x.t() of a contiguous (n_in, batch)) runs the fast feature-major kernels and
    gives y the same way; a row-major x is transposed to it once first (row_major="auto" outside
    torch.compile, or "transpose"), y then feature-major too, dx row-major as x; without a gradient "auto"
    runs the row-major forward, which reads x once (whole rows in shared memory; y row-major).
    row_major="direct" (and "auto" under torch.compile) runs the row-major kernels (y row-major; the
    backward gathers within rows: slower); "staged" the row-major forward in training too (x and dy
    transposed in the backward) where it pays, else as "auto"."""
    from . import _difflogic

    return _difflogic.logic_layer(x, logits, a, b, mode=mode, grad_factor=grad_factor, consumers_csr=consumers,
                                  row_major=row_major)


def group_sum(x: Array, k: int, tau: float = 1.0) -> Array:
    """difflogic's GroupSum on kspec's kernels: x (..., n) -> (..., k), the sums of k equal groups of n / k
    divided by tau, in x's dtype; differentiable (dx = dy / tau over each group)."""
    from . import _difflogic

    return _difflogic.group_sum(x, k, tau)


def difflogic_pack(x: Array, w: int = 32) -> Array:
    """{0,1} (batch, n) -> words (n, ceil(batch / w)) int32 (w = 32) or int64 (w = 64); sample s is bit
    s mod w of word s // w, padding bits 0."""
    from . import _difflogic

    return _difflogic.pack(x, w)


def difflogic_unpack(words: Array, batch: int) -> Array:
    """difflogic_pack's inverse: words (n, ceil(batch / w)) -> (batch, n) uint8 {0,1}."""
    from . import _difflogic

    return _difflogic.unpack(words, batch)


def difflogic_packed(words: Array, logits: Array, a: Array, b: Array, batch: int) -> Array:
    """One hard logic layer on packed samples: words (n_in, ceil(batch / w)) int32/int64 -> (n_out, same) of
    the same dtype (each gate's argmax op, bitwise; padding bits cleared). Not differentiable."""
    from . import _difflogic

    return _difflogic.packed_layer(words, logits, a, b, batch)


def difflogic_packed_net(words: Array, layers: Sequence[tuple[Array, Array, Array]], batch: int, k: int,
                         config: str | None = None) -> Array:
    """A packed network in one op: words (n_in, ceil(batch / w)) int32/int64 through hard layers
    [(logits (n_l, 16), a, b (n_l,)), ...], then GroupSum: (batch, k) int32 counts of set bits in each of k
    equal groups of the last layer's gates. config picks the algorithm ("algo=chunked,chunk=64,inflight=2":
    one launch, each chunk of samples through every layer in L2; "algo=layers,chunk=128,inflight=2": a launch
    per layer). A config names every axis."""
    from . import _difflogic

    return _difflogic.packed_net(words, layers, batch, k, config)


def difflogic_packed_group_sum(words: Array, batch: int, k: int) -> Array:
    """GroupSum on packed outputs: (batch, k) int64 counts of set bits in each of k equal groups of rows."""
    from . import _difflogic

    return _difflogic.packed_group_sum(words, batch, k)
