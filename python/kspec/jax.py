"""kspec.jax: kspec's ops as JAX functions — XLA custom calls (XLA's typed FFI) into the same registry call
C++ and torch make, differentiable through jax.custom_vjp with kspec's backward kernels, under jax.jit,
jax.grad and jax.value_and_grad. Tensors stay on the GPU; nothing is copied around the call.

    import jax, jax.numpy as jnp, kspec.jax as kj
    y = kj.norm_act(x, w, norm="rmsnorm", act="silu")
    out = kj.selective_scan(u, delta, A, B, C, D, z, delta_softplus=True, layout="bld")  # Nx's order
    g = jax.grad(lambda u: kj.selective_scan(u, delta, A, B, C).sum())(u)

The handlers are registered with jaxlib's XLA for the "CUDA" platform at import (kspec._xla lists the
targets). Importing needs jax and a kspec built with XLA's FFI headers (jax installed when kspec was
built); otherwise ImportError says which is missing."""
from __future__ import annotations

import functools
from typing import NamedTuple

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
except ImportError as e:
    raise ImportError(f"kspec.jax needs jax (pip install jax; for GPUs jax[cuda12] or jax[cuda13]): {e}") from e

from . import _C, _xla

if not _xla.available():
    raise ImportError("kspec.jax: this kspec was built without XLA's FFI headers (jax was not installed when it "
                      "was built); install jax, then reinstall kspec (PYTHON=<python> bash tools/install.sh)")

PLATFORM = "CUDA"
_STATE_STRIDE = _C.op_info("selective_scan.fwd")["constants"]["state_stride"]


def _register() -> None:
    # Both stages: the initialize handler compiles before an execution (never inside a command buffer).
    for t in _xla.targets():
        stages = {s: _C._xla_handler(t["target"], s) for s in ("initialize", "execute")}
        jax.ffi.register_ffi_target(t["target"], stages, platform=PLATFORM)


_register()  # once: a module body runs once per process

__all__ = ["selective_scan", "selective_scan_step", "norm_act", "e79_cell", "AdamWState", "adamw_init", "adamw_step",
           "GradientTransformation", "adamw", "PLATFORM"]


def _attr(v):
    """A Python value as the XLA attribute type the handlers read (i1, i64, f64, string)."""
    if isinstance(v, (bool, np.bool_)):
        return np.bool_(v)
    if isinstance(v, (int, np.integer)):
        return np.int64(v)
    if isinstance(v, (float, np.floating)):
        return np.float64(v)
    return str(v)


def _ffi(target, results, operands, inputs, outputs, *, aliases=None, **params):
    """One custom call: operands named by `inputs`, results by `outputs` (the target table's protocol). Every
    operand and result has XLA's default (row-major) layout: the handlers read buffers as they lie."""
    attrs = {k: _attr(v) for k, v in params.items()}
    call = jax.ffi.ffi_call(target, results, input_output_aliases=aliases)
    return call(*operands, inputs=",".join(inputs), outputs=",".join(outputs), **attrs)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


# ---- selective scan ----

_SCAN_OPTIONAL = ("D", "z", "delta_bias", "h0")


def _scan_dims(u, A, bld):
    b = u.shape[0]
    dim, seqlen = (u.shape[2], u.shape[1]) if bld else (u.shape[1], u.shape[2])
    return b, dim, seqlen, A.shape[1]


def _scan_forward(args, names, softplus, layout, save):
    bld = layout == "bld"
    u, A = args[0], args[2]
    b, dim, seqlen, dstate = _scan_dims(u, A, bld)
    outs = ["out", "last_state"] + (["states"] if save else [])
    results = [_spec(u.shape, u.dtype), _spec((b, dim, dstate), jnp.float32)]
    if save:
        results.append(_spec((b, dim, -(-seqlen // _STATE_STRIDE), dstate), jnp.float32))
    return _ffi("kspec_selective_scan_fwd", results, args, names, outs, layout=layout, delta_softplus=softplus)


@functools.lru_cache(maxsize=None)
def _scan_fn(names: tuple, softplus: bool, layout: str):
    """The differentiable scan over the given tensors (names: the inputs present, in the op's order)."""

    @jax.custom_vjp
    def scan(*args):
        out, last = _scan_forward(args, names, softplus, layout, save=False)
        return out, last

    def fwd(*args):
        out, last, states = _scan_forward(args, names, softplus, layout, save=True)
        return (out, last), (args, states)

    def bwd(res, cts):
        args, states = res
        dout, dlast = cts
        dout = dout.astype(args[0].dtype)
        ops = (dout,) + tuple(args) + (dlast.astype(jnp.float32), states)
        in_names = ("dout",) + names + ("dlast_state", "states")
        grads = {"u": "du", "delta": "ddelta", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
                 "delta_bias": "ddelta_bias", "h0": "dh0"}
        out_names = [grads[n] for n in names]
        results = [_spec(a.shape, a.dtype) for a in args]
        res_grads = _ffi("kspec_selective_scan_bwd", results, ops, in_names, out_names, layout=layout,
                         delta_softplus=softplus)
        return tuple(res_grads)

    scan.defvjp(fwd, bwd)
    return scan


_BLD_MODES = ("in_place", "transpose")


def _bld_to_bdl(a):
    """A bld operand in bdl's order: [batch, seqlen, dim] -> [batch, dim, seqlen]; B/C [batch, seqlen, dstate]
    -> [batch, dstate, seqlen], [batch, seqlen, groups, dstate] -> [batch, groups, dstate, seqlen]."""
    return jnp.swapaxes(a, 1, 2) if a.ndim == 3 else jnp.transpose(a, (0, 2, 3, 1))


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, h0=None,
                   layout="bdl", return_last_state=False, bld_mode="in_place"):
    """The Mamba (S6) selective scan, mamba_ssm's selective_scan_fn arguments plus h0 (kspec.ops.selective_scan_fn).

    layout "bdl": u, delta, z (batch, dim, seqlen); B, C (batch, dstate, seqlen) or (batch, groups, dstate,
    seqlen). layout "bld": u, delta, z (batch, seqlen, dim); B, C (batch, seqlen, dstate) or (batch, seqlen,
    groups, dstate) — Nx's order, row-major buffers read and written where they lie (the op's layout "bld":
    the sequential kernels' time-major path in one segment; XLA adds no transposes around the call). In both:
    B, C may be fixed (dim, dstate); A (dim, dstate) fp32; D, delta_bias (dim,) fp32; h0 (batch, dim,
    dstate) fp32. u fp32/fp16/bf16; delta, z and variable B, C like u (B, C may be fp32).
    Returns out (like u) and with return_last_state also last_state (batch, dim, dstate) fp32.
    Differentiable in every array argument (jax.grad: kspec's backward, which reads the states the
    forward kept every 16th step).

    bld_mode (layout "bld" only): "in_place" (the default, as issue 32 asks: no transposes around the call;
    what EXLA's calls do) runs the op's time-major kernels on the buffers as they lie; "transpose" has XLA
    transpose u, delta, z, B, C to bdl (a copy kernel each; out and the gradients back), then runs the bdl
    kernels, which is faster on the H100 though it moves more bytes: H100, bf16, ms (run 20):
    forward at (8, 2048, 2048) 0.458 transposed against 1.147 in place (bdl 0.263), forward + backward 1.832
    against 2.483 (bdl 1.484); at (4, 1536, 1000) forward 0.139 against 0.315. The transposed copies of
    u, delta, z, B, C are the backward's residuals (their bytes again, until the backward)."""
    if layout not in ("bdl", "bld"):
        raise ValueError(f"kspec.jax.selective_scan: layout must be 'bdl' or 'bld', got {layout!r}")
    if bld_mode not in _BLD_MODES:
        raise ValueError(f"kspec.jax.selective_scan: bld_mode must be one of {_BLD_MODES}, got {bld_mode!r}")
    if layout == "bld" and bld_mode == "transpose":
        t = lambda a: None if a is None else _bld_to_bdl(a)  # noqa: E731
        B, C = (x if x.ndim == 2 else t(x) for x in (B, C))  # fixed (dim, dstate) B/C have no seqlen
        res = selective_scan(t(u), t(delta), A, B, C, D, t(z), delta_bias, delta_softplus, h0, layout="bdl",
                             return_last_state=True)
        out = jnp.swapaxes(res[0], 1, 2)
        return (out, res[1]) if return_last_state else out
    # 3-D B and C go in as given (the handler reads them as one group): a reshape to (batch, 1, dstate,
    # seqlen) would be a copy kernel each under XLA, whose layout assignment puts the unit dimension elsewhere
    given = dict(zip(("D", "z", "delta_bias", "h0"), (D, z, delta_bias, h0)))
    names = ("u", "delta", "A", "B", "C") + tuple(n for n in _SCAN_OPTIONAL if given[n] is not None)
    args = (u, delta, A, B, C) + tuple(given[n] for n in _SCAN_OPTIONAL if given[n] is not None)
    out, last = _scan_fn(names, bool(delta_softplus), layout)(*args)
    return (out, last) if return_last_state else out


def selective_scan_step(state, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """One decode step: returns (out (batch, dim) like u, new_state (batch, dim, dstate) fp32). new_state is
    written into state's buffer (an aliased result): jit with state donated to update it in place.
    state (batch, dim, dstate) fp32; u, delta, z (batch, dim) fp32/fp16/bf16; B, C (batch, dstate) or (batch,
    groups, dstate), like u or fp32; A (dim, dstate) fp32; D, delta_bias (dim,) fp32. Not differentiable
    (as kspec.ops.selective_scan_step)."""
    if B.ndim == 2:
        B = B[:, None]
    if C.ndim == 2:
        C = C[:, None]
    given = dict(zip(("D", "z", "delta_bias"), (D, z, delta_bias)))
    names = ("state", "u", "delta", "A", "B", "C") + tuple(n for n in given if given[n] is not None)
    args = (state, u, delta, A, B, C) + tuple(given[n] for n in given if given[n] is not None)
    results = [_spec(u.shape, u.dtype), _spec(state.shape, jnp.float32)]
    out, new_state = _ffi("kspec_selective_scan_step", results, args, names, ("out", "new_state"), aliases={0: 1},
                          delta_softplus=bool(delta_softplus))
    return out, new_state


# ---- norm_act ----

@functools.lru_cache(maxsize=None)
def _norm_act_fn(has_bias: bool, norm: str, act: str, eps: float):
    names = ("x", "weight") + (("bias",) if has_bias else ())
    params = dict(norm=norm, act=act, eps=eps)

    def forward(args, save):
        x = args[0]
        y = _spec(x.shape, x.dtype)
        if not save:  # no gradient taken: the statistics are not written (as torch's path without grad)
            return _ffi("kspec_norm_act_fwd", [y], args, names, ("y",), save_stats=False, **params)
        stats = _spec(x.shape[:-1], jnp.float32)
        return _ffi("kspec_norm_act_fwd", [y, stats, stats], args, names, ("y", "mean", "rstd"), **params)

    @jax.custom_vjp
    def f(*args):
        return forward(args, save=False)[0]

    def fwd(*args):
        y, mean, rstd = forward(args, save=True)
        return y, (args, mean, rstd)

    def bwd(res, dy):
        args, mean, rstd = res
        ops = (dy.astype(args[0].dtype),) + tuple(args) + (mean, rstd)
        in_names = ("dy",) + names + ("mean", "rstd")
        out_names = ("dx", "dweight") + (("dbias",) if has_bias else ())
        return tuple(_ffi("kspec_norm_act_bwd", [_spec(a.shape, a.dtype) for a in args], ops, in_names, out_names,
                          **params))

    f.defvjp(fwd, bwd)
    return f


def norm_act(x, weight, bias=None, *, norm="layernorm", act="identity", eps=1e-5):
    """y = act(norm(x) * weight + bias) over the last dim (kspec.ops.norm_act): norm layernorm/rmsnorm, act
    identity/silu/gelu_tanh/gelu_erf, statistics in fp32. x (..., hidden) fp32/fp16/bf16; weight, bias
    (hidden,) like x or fp32. Differentiable in x, weight and bias."""
    f = _norm_act_fn(bias is not None, str(norm), str(act), float(eps))
    return f(x, weight) if bias is None else f(x, weight, bias)


# ---- e79 ----

_E79_MODES = ("none", "fixed", "input")


@functools.lru_cache(maxsize=None)
def _e79_fn(n: int, mode: str, has_s0: bool, has_m0: bool, chunk: int):
    cols = 6 if mode == "input" else 4

    def kernel_inputs(kvqm, b_s, b_m, S0, M0):
        blocks = [kvqm[..., j * n:(j + 1) * n] for j in range(cols)]
        names, ops = ["k", "v", "q", "m"], blocks[:4]
        bs, bm = (blocks[4], blocks[5]) if mode == "input" else (b_s, b_m)
        for name, a in (("b_s", bs), ("b_m", bm), ("S0", S0), ("M0", M0)):
            if a is not None:
                names.append(name)
                ops.append(a)
        return names, ops

    def forward(args, save):
        kvqm = args[0]
        T, B = kvqm.shape[0], kvqm.shape[1]
        names, ops = kernel_inputs(*args)
        state = _spec((B, n, n), jnp.float32)
        results = [_spec((T, B, n), kvqm.dtype), state, state]
        outs = ["out", "S", "M"]
        if save:
            results.append(_spec((B, -(-T // chunk), 2, n, n), jnp.float32))
            outs.append("checkpoints")
        return _ffi("kspec_e79_fwd", results, ops, names, outs, chunk=chunk)

    @jax.custom_vjp
    def cell(kvqm, b_s, b_m, S0, M0):
        return tuple(forward((kvqm, b_s, b_m, S0, M0), save=False))

    def fwd(kvqm, b_s, b_m, S0, M0):
        out, S, M, chk = forward((kvqm, b_s, b_m, S0, M0), save=True)
        return (out, S, M), ((kvqm, b_s, b_m, S0, M0), chk)

    def bwd(res, cts):
        args, chk = res
        kvqm = args[0]
        dout, dS, dM = cts
        names, ops = kernel_inputs(*args)
        in_names = ["dout"] + names + ["checkpoints", "dS", "dM"]
        ops = [dout.astype(kvqm.dtype)] + ops + [chk, dS.astype(jnp.float32), dM.astype(jnp.float32)]
        grads = {"k": "dk", "v": "dv", "q": "dq", "m": "dm", "b_s": "db_s", "b_m": "db_m", "S0": "dS0", "M0": "dM0"}
        out_names = [grads[nm] for nm in names]
        shapes = [_spec(a.shape, a.dtype) for a in ops[1:1 + len(names)]]
        g = dict(zip(names, _ffi("kspec_e79_bwd", shapes, ops, in_names, out_names, chunk=chunk)))
        blocks = [g["k"], g["v"], g["q"], g["m"]] + ([g["b_s"], g["b_m"]] if mode == "input" else [])
        fixed = mode == "fixed"
        return (jnp.concatenate(blocks, axis=-1), g["b_s"] if fixed else None, g["b_m"] if fixed else None,
                g.get("S0"), g.get("M0"))

    cell.defvjp(fwd, bwd)
    return cell


def e79_cell(kvqm, n: int, b_s=None, b_m=None, S0=None, M0=None, *, bias: str = "fixed", chunk: int = 16):
    """The E79 coupled memory-modulation cell (kspec.ops.e79_cell): kvqm (T, B, 4n) columns [k | v | q | m],
    or (T, B, 6n) [k | v | q | m | b_s | b_m] with bias="input"; fp32/fp16/bf16. b_s, b_m (n,) with
    bias="fixed" (dtype of kvqm or fp32). S0, M0 (B, n, n) fp32 or None (zeros). Returns (out (T, B, n)
    like kvqm, S, M (B, n, n) fp32). Differentiable in kvqm, b_s, b_m, S0 and M0 (the forward keeps (S, M)
    every `chunk` steps, the backward recomputes each segment once)."""
    if bias not in _E79_MODES:
        raise ValueError(f"kspec.jax.e79_cell: bias must be one of {_E79_MODES}, got {bias!r}")
    cols = 6 if bias == "input" else 4
    if kvqm.ndim != 3 or kvqm.shape[-1] != cols * n:
        raise ValueError(f"kspec.jax.e79_cell: kvqm must be (T, B, {cols}n) = (T, B, {cols * n}) for n = {n} and "
                         f"bias={bias!r}, got {tuple(kvqm.shape)}")
    if bias == "fixed" and (b_s is None or b_m is None):
        raise ValueError("kspec.jax.e79_cell: bias='fixed' needs b_s and b_m of shape (n,)")
    if bias != "fixed":
        b_s = b_m = None
    return _e79_fn(int(n), bias, S0 is not None, M0 is not None, int(chunk))(kvqm, b_s, b_m, S0, M0)


# ---- AdamW ----

class AdamWState(NamedTuple):
    """exp_avg, exp_avg_sq: fp32 pytrees like params; master: fp32 copies of 16-bit params (None when every
    param is fp32); max_exp_avg_sq: AMSGrad's running max (None without AMSGrad); step: the steps taken
    (int32 scalar)."""
    exp_avg: object
    exp_avg_sq: object
    master: object
    max_exp_avg_sq: object
    step: object


def adamw_init(params, *, amsgrad: bool = False) -> AdamWState:
    """The state for adamw_step: zero moments, fp32 masters of 16-bit params, step 0."""
    leaves = jax.tree_util.tree_leaves(params)
    zeros = lambda: jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # noqa: E731
    needs_master = any(p.dtype != jnp.float32 for p in leaves)
    master = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params) if needs_master else None
    return AdamWState(zeros(), zeros(), master, zeros() if amsgrad else None, jnp.zeros((), jnp.int32))


def adamw_step(params, grads, state: AdamWState, *, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=1e-2, maximize=False, max_norm=0.0, grad_scale=None, donate=False):
    """One fused multi-tensor AdamW step (torch.optim.AdamW semantics; kspec.optim.AdamW's kernel).
    Returns (new_params, new_state, grad_norm) — grad_norm (1,) fp32 when max_norm > 0, else None.
    params and the state's tensors are updated in the buffers they came in (aliased results), when XLA
    may: jit with params and state donated (donate_argnums) for no copies (and the handler's bound call,
    built for the buffers' addresses, is then reused step after step). Without donation XLA copies each of
    them first (three to five times the parameters' bytes: the step's time doubles). Called outside jit,
    the step runs as one jitted function of its own; donate=True donates params and state to it (updated
    in place; the arrays passed are deleted, as with donate_argnums). Under jit, donate the jitted
    function's arguments instead (donate=True there is an error: it could not take effect).
    lr may be a traced scalar (a schedule): it and the step count are operands (fp32 (1,) device scalars,
    the op's device_lr and device_step) read by the kernel itself, so they change without recompiling and
    without the host waiting for the stream. grad_scale: (1,) fp32 AMP loss scale or None."""
    hyper = dict(beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
                 maximize=bool(maximize), max_norm=float(max_norm))
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((params, grads, state, lr, grad_scale))):
        if donate:
            raise ValueError("kspec.jax.adamw_step: donate=True under jit cannot take effect; donate params and "
                             "state with the jitted function's donate_argnums")
        return _adamw_step(params, grads, state, lr, grad_scale, **hyper)
    return _adamw_step_jit(bool(donate))(params, grads, state, lr, grad_scale, **hyper)


@functools.lru_cache(maxsize=None)
def _adamw_step_jit(donate: bool):
    """adamw_step outside jit: one compiled step (the eager ops and custom call dispatched one by one would
    each be compiled apart, and without donation XLA copies every aliased operand)."""
    return jax.jit(_adamw_step, static_argnames=("beta1", "beta2", "eps", "weight_decay", "maximize", "max_norm"),
                   donate_argnums=(0, 2) if donate else ())


def _adamw_step(params, grads, state, lr, grad_scale, *, beta1, beta2, eps, weight_decay, maximize, max_norm):
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    g_leaves = treedef.flatten_up_to(grads)
    lists = [("params", p_leaves), ("grads", g_leaves), ("exp_avg", treedef.flatten_up_to(state.exp_avg)),
             ("exp_avg_sq", treedef.flatten_up_to(state.exp_avg_sq))]
    if state.master is not None:
        lists.append(("master", treedef.flatten_up_to(state.master)))
    if state.max_exp_avg_sq is not None:
        lists.append(("max_exp_avg_sq", treedef.flatten_up_to(state.max_exp_avg_sq)))
    step = state.step + 1
    names = ["device_lr", "device_step"] + [name for name, _ in lists]
    # fp32 holds every step count up to 2**24 exactly
    ops = [jnp.asarray(lr, jnp.float32).reshape((1,)), step.astype(jnp.float32).reshape((1,))]
    ops += [a for _, xs in lists for a in xs]
    if grad_scale is not None:
        names.append("grad_scale")
        ops.append(jnp.asarray(grad_scale, jnp.float32).reshape((1,)))
    in_place = [name for name, _ in lists if name != "grads"]
    n = len(p_leaves)
    aliases, results, r = {}, [], 0
    first = {name: 2 + sum(len(xs) for _, xs in lists[:i]) for i, (name, _) in enumerate(lists)}
    for name, xs in lists:
        if name in in_place:
            for k, a in enumerate(xs):
                aliases[first[name] + k] = r
                results.append(_spec(a.shape, a.dtype))
                r += 1
    outs = list(in_place)
    want_norm = max_norm > 0
    if want_norm:
        outs.append("grad_norm")
        results.append(_spec((1,), jnp.float32))
    res = _ffi("kspec_adamw", results, ops, names, outs, aliases=aliases, tensors=n, beta1=beta1, beta2=beta2,
               eps=eps, weight_decay=weight_decay, maximize=maximize, max_norm=max_norm)
    updated, k = {}, 0
    for name in in_place:
        updated[name] = jax.tree_util.tree_unflatten(treedef, res[k:k + n])
        k += n
    new_state = AdamWState(updated["exp_avg"], updated["exp_avg_sq"], updated.get("master"),
                           updated.get("max_exp_avg_sq"), step)
    return updated["params"], new_state, (res[k] if want_norm else None)


class GradientTransformation(NamedTuple):
    """optax.GradientTransformation's two fields, so optax.chain and optax.apply_updates take kspec's AdamW
    without kspec importing optax: init(params) -> state; update(updates, state, params) -> (updates, state)."""
    init: object
    update: object


def adamw(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, *, amsgrad=False, maximize=False,
          max_norm=0.0) -> GradientTransformation:
    """optax.adamw's arguments (and defaults) as an (init, update) pair on adamw_step's fused kernel:

        tx = kspec.jax.adamw(1e-3, weight_decay=0.01)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)

    learning_rate: a float or a schedule (a function of the step count, as optax's), evaluated on device
    and read by the handler: no recompilation as it changes. The kernel computes the new params; the
    updates are new - old (fp32 for 16-bit params, whose fp32 master copy lives in the state, so
    apply_updates lands on the kernel's params up to one rounding), and `params` is required. Last in an
    optax.chain (the gradients it gets are the ones it steps with). Inside jit the params' buffers are
    not donated through this interface: use adamw_step with donate_argnums for the in-place update."""
    for name, v, lo, hi in (("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0)):
        if not lo <= float(v) < hi:
            raise ValueError(f"kspec.jax.adamw: {name} must be in [0, 1), got {v!r}")
    for name, v in (("eps", eps), ("weight_decay", weight_decay), ("max_norm", max_norm)):
        if not float(v) >= 0.0:
            raise ValueError(f"kspec.jax.adamw: {name} must be >= 0, got {v!r}")
    if not callable(learning_rate) and not float(learning_rate) >= 0.0:
        raise ValueError(f"kspec.jax.adamw: learning_rate must be >= 0 or a schedule, got {learning_rate!r}")

    def init(params):
        return adamw_init(params, amsgrad=amsgrad)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("kspec.jax.adamw: update(grads, state, params) needs params (the fused kernel "
                             "computes the new params from them)")
        if not isinstance(state, AdamWState):
            raise TypeError(f"kspec.jax.adamw: state must be the AdamWState of init(params), got "
                            f"{type(state).__name__}")
        lr = learning_rate(state.step) if callable(learning_rate) else learning_rate
        new, new_state, _ = adamw_step(params, updates, state, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                       weight_decay=weight_decay, maximize=maximize, max_norm=max_norm)
        delta = jax.tree_util.tree_map(
            lambda n, p: n - p if p.dtype == jnp.float32 else n.astype(jnp.float32) - p.astype(jnp.float32),
            new, params)
        return delta, new_state

    return GradientTransformation(init, update)
