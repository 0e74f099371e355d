"""The jax family (issue 32): kspec.jax, kspec's ops as XLA custom calls, against kspec's torch path on the
same inputs (the FFI should add nothing), and against what a JAX user writes without kspec: the scan as
jax.lax.associative_scan and as jax.lax.scan, XLA's fused layer_norm + silu, optax's adamw, all jitted. The
scan also runs in Nx's layout ([batch, seqlen, dim]; kspec.jax bld (in place): read where it lies by the
time-major kernels; kspec.jax bld (transpose), bld_mode="transpose": transposed by XLA around the bdl kernels). norm_act's table splits a
forward's host time: JAX's own cost per call, the statistics' results, the initialize stage, and 10 calls
inside one jit.
AdamW's table splits what is JAX's from what is kspec's: a jitted identity over the same ~1000 arguments
(JAX's own cost per call) and 10 steps inside one jit (the step without that cost), kspec's and optax's.

Timing: JAX runs on its own stream, which torch's CUDA events do not see, so every row here (the torch rows
too, for one method) is the wall clock of `--jax-calls` calls queued back to back, then one wait, divided by
the calls: the GPU time per call once the queue is full (each call here takes 0.1 ms or more of GPU time,
far above either framework's launch cost). Before timing, kspec.jax's outputs must equal the torch path's
(the same kernels: bitwise) and each pure-JAX peer must match kspec within the dtype's tolerance (a peer
that does not is still timed, flagged INVALID). Run it on its own: --family jax (not part of `all`)."""
from __future__ import annotations

import os
import statistics
import time

from .common import NoGpu, Section, short_error
from .report import fmt

FAMILY = "jax"
DESCRIPTION = "kspec.jax (XLA FFI) against kspec's torch path, jax.lax scans, XLA layer_norm+silu, optax adamw"
IN_ALL = False

SCAN_SHAPES = [(8, 2048, 2048), (4, 1536, 1000)]  # (batch, dim, seqlen), dstate 16: the torch benchmarks'
DSTATE = 16
NORM_SHAPE = (16384, 4096)
BLD_IN = "kspec.jax bld (in place)"  # bld_mode="in_place": the time-major kernels on the bld buffers
BLD_T = "kspec.jax bld (transpose)"  # bld_mode="transpose" (opt-in): XLA transposes to bdl around the bdl kernels
_ALIASES = set()  # targets the bench registered itself (kspec's handlers under another name)


def add_arguments(p):
    p.add_argument("--jax-calls", type=int, default=20, help="calls queued back to back per timing (default 20)")
    p.add_argument("--jax-repeats", type=int, default=7, help="timings per variant, median taken (default 7)")


def _wall_ms(fn, sync, calls, repeats, steps=1):
    """ms: wall clock per call, `calls` queued back to back then one wait (median of `repeats`); host_ms: the
    time one call takes to return on an idle queue (median), what the host spends before the GPU is given
    the work; both per step when one call runs `steps` steps."""
    for _ in range(3):
        fn()
    sync()
    host = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3 / steps)
        sync()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per.append((time.perf_counter() - t0) / calls * 1e3 / steps)
    return {"ms": statistics.median(per), "min_ms": min(per), "host_ms": statistics.median(host)}


def _rel(a, b, np):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _scan_peers(jax, jnp):
    """The selective scan as a JAX user writes it (Mamba flags: D, z, delta_bias, softplus), fp32 inside."""

    def prep(u, delta, A, B, C, D, z, delta_bias):
        dt = jax.nn.softplus(delta.astype(jnp.float32) + delta_bias[None, :, None])  # [b, d, l]
        return dt, u.astype(jnp.float32), B.astype(jnp.float32), C.astype(jnp.float32)

    def finish(y, u, D, z):
        y = y + D[None, :, None] * u
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)

    def associative(u, delta, A, B, C, D, z, delta_bias):
        dt, u32, B32, C32 = prep(u, delta, A, B, C, D, z, delta_bias)
        dA = jnp.exp(dt[..., None] * A[None, :, None, :])                       # [b, d, l, n]
        dBu = (dt * u32)[..., None] * jnp.swapaxes(B32, 1, 2)[:, None]           # B [b, n, l] -> [b, 1, l, n]

        def combine(x, y):
            return x[0] * y[0], y[0] * x[1] + y[1]

        _, h = jax.lax.associative_scan(combine, (dA, dBu), axis=2)
        y = jnp.einsum("bdln,bln->bdl", h, jnp.swapaxes(C32, 1, 2))
        return finish(y, u32, D, z)

    def sequential(u, delta, A, B, C, D, z, delta_bias):
        dt, u32, B32, C32 = prep(u, delta, A, B, C, D, z, delta_bias)

        def step(h, xs):
            dt_t, u_t, B_t, C_t = xs                                              # [b, d], [b, d], [b, n], [b, n]
            h = jnp.exp(dt_t[..., None] * A[None]) * h + (dt_t * u_t)[..., None] * B_t[:, None, :]
            return h, jnp.einsum("bdn,bn->bd", h, C_t)

        b, d, _ = u.shape
        xs = (jnp.moveaxis(dt, 2, 0), jnp.moveaxis(u32, 2, 0), jnp.moveaxis(B32, 2, 0), jnp.moveaxis(C32, 2, 0))
        _, ys = jax.lax.scan(step, jnp.zeros((b, d, A.shape[1]), jnp.float32), xs)
        return finish(jnp.moveaxis(ys, 0, 2), u32, D, z)

    return {"jax.lax.associative_scan": associative, "jax.lax.scan": sequential}


def _scan_section(ctx, jax, jnp, np, kj, torch, kspec):
    rows = []
    rng = np.random.default_rng(ctx.seed)
    peers = _scan_peers(jax, jnp)
    for (b, d, L) in SCAN_SHAPES if not ctx.quick else [(2, 256, 512)]:
        n = DSTATE
        host = dict(u=rng.standard_normal((b, d, L)), delta=rng.standard_normal((b, d, L)),
                    A=-(0.25 + np.abs(rng.standard_normal((d, n)))), B=rng.standard_normal((b, n, L)),
                    C=rng.standard_normal((b, n, L)), D=rng.standard_normal(d), z=rng.standard_normal((b, d, L)),
                    delta_bias=rng.standard_normal(d))
        bf = {"u", "delta", "B", "C", "z"}
        j = {k: jnp.asarray(v, jnp.bfloat16 if k in bf else jnp.float32) for k, v in host.items()}
        names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
        args = [j[k] for k in names]
        dout = jnp.asarray(rng.standard_normal((b, d, L)), jnp.bfloat16)

        def kspec_fn(u, delta, A, B, C, D, z, delta_bias):
            return kj.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)

        def kspec_bld_fn(u, delta, A, B, C, D, z, delta_bias):
            return kj.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True, layout="bld",
                                     bld_mode="in_place")

        def kspec_bld_t_fn(u, delta, A, B, C, D, z, delta_bias):
            return kj.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True, layout="bld",
                                     bld_mode="transpose")

        def fwd_bwd(f):
            return jax.jit(lambda dout, *a: jax.vjp(f, *a)[1](dout))

        fwd = {"kspec.jax": jax.jit(kspec_fn), BLD_IN: jax.jit(kspec_bld_fn), BLD_T: jax.jit(kspec_bld_t_fn)}
        fb = {"kspec.jax": fwd_bwd(kspec_fn), BLD_IN: fwd_bwd(kspec_bld_fn), BLD_T: fwd_bwd(kspec_bld_t_fn)}
        for name, f in peers.items():
            fwd[name] = jax.jit(f)
            fb[name] = fwd_bwd(f)
        # bld: Nx's [batch, seqlen, dim] (B, C [batch, seqlen, dstate]), made once: read in place by the op's
        # time-major kernels (algo=sequential, one segment), or transposed by XLA around the bdl kernels; the
        # output is transposed back to be checked.
        swap = {"u", "delta", "B", "C", "z"}
        bld_args = [jax.block_until_ready(jnp.swapaxes(j[k], 1, 2)) if k in swap else j[k] for k in names]
        bld_dout = jax.block_until_ready(jnp.swapaxes(dout, 1, 2))
        ref = np.asarray(fwd["kspec.jax"](*args), np.float32)
        t = {k: torch.from_dlpack(jax.block_until_ready(j[k])) for k in names}
        t_out = kspec.ops.selective_scan_fn(*(t[k] for k in names[:5]), t["D"], t["z"], t["delta_bias"], True)
        same = bool(np.array_equal(ref, t_out.float().cpu().numpy()))
        shape = f"({b}, {d}, {L})"
        tol = kspec.op_info("selective_scan.fwd")["tolerances"]["bfloat16"]

        for mode, table in (("fwd", fwd), ("fwd+bwd", fb)):
            for name, f in table.items():
                if ctx.skipped(name):
                    continue
                row = {"shape": shape, "pass": mode, "variant": name}
                bld = name in (BLD_IN, BLD_T)
                a, g = (bld_args, bld_dout) if bld else (args, dout)
                try:
                    if mode == "fwd":
                        call = lambda f=f, a=a: f(*a)  # noqa: E731
                        out = np.asarray(call(), np.float32)
                        if bld:
                            out = np.swapaxes(out, 1, 2)
                        row["rel_err"] = _rel(out, ref, np) if name != "kspec.jax" else 0.0
                    else:
                        call = lambda f=f, a=a, g=g: f(g, *a)  # noqa: E731
                        call()
                    if name == "kspec.jax":
                        row["valid"] = same if mode == "fwd" else True
                    else:
                        row["valid"] = row.get("rel_err", 0.0) <= tol
                    last = [None]

                    def run(call=call, last=last):
                        last[0] = call()

                    row.update(_wall_ms(run, lambda last=last: jax.block_until_ready(last[0]), ctx.jax_calls,
                                        ctx.jax_repeats))
                except Exception as e:  # noqa: BLE001 (an OOM or a failing peer is a row, not the end)
                    row["error"] = short_error(e, 300)
                rows.append(row)
            # kspec's torch path, same method
            tw = {k: v.clone().requires_grad_(mode == "fwd+bwd" and v.dtype.is_floating_point) for k, v in t.items()}
            t_dout = torch.from_dlpack(jax.block_until_ready(dout))

            def torch_call(mode=mode, tw=tw):
                out = kspec.ops.selective_scan_fn(*(tw[k] for k in names[:5]), tw["D"], tw["z"], tw["delta_bias"], True)
                if mode == "fwd+bwd":
                    out.backward(t_dout)

            try:
                rows.append({"shape": shape, "pass": mode, "variant": "kspec torch", "valid": True,
                             **_wall_ms(torch_call, torch.cuda.synchronize, ctx.jax_calls, ctx.jax_repeats)})
            except Exception as e:  # noqa: BLE001
                rows.append({"shape": shape, "pass": mode, "variant": "kspec torch", "error": short_error(e, 300)})
        _ratios(rows, shape)
    return rows


def _ratios(rows, shape):
    """Each row's time relative to kspec.jax's (same shape and pass)."""
    for mode in ("fwd", "fwd+bwd"):
        base = [r for r in rows if r.get("shape") == shape and r["pass"] == mode and r["variant"] == "kspec.jax"]
        if not base or "ms" not in base[0]:
            continue
        for r in rows:
            if r.get("shape") == shape and r["pass"] == mode and "ms" in r:
                r["vs_kspec_jax"] = r["ms"] / base[0]["ms"]


def _norm_section(ctx, jax, jnp, np, kj, torch, kspec):
    rows = []
    rng = np.random.default_rng(ctx.seed + 1)
    R, H = NORM_SHAPE if not ctx.quick else (1024, 1024)
    x = jnp.asarray(rng.standard_normal((R, H)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(H), jnp.bfloat16)
    bb = jnp.asarray(0.1 * rng.standard_normal(H), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((R, H)), jnp.bfloat16)

    def kspec_fn(x, w, bb):
        return kj.norm_act(x, w, bb, norm="layernorm", act="silu")

    def xla_fn(x, w, bb):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * w.astype(jnp.float32) + bb.astype(jnp.float32)
        return jax.nn.silu(y).astype(x.dtype)

    ref = np.asarray(jax.jit(kspec_fn)(x, w, bb), np.float32)
    shape = f"({R}, {H})"
    tol = kspec.op_info("norm_act.fwd")["tolerances"]["bfloat16"]
    tx, tw_, tb = (torch.from_dlpack(jax.block_until_ready(a)) for a in (x, w, bb))
    same = bool(np.array_equal(ref, kspec.ops.norm_act(tx, tw_, tb, norm="layernorm", act="silu").float().cpu().numpy()))
    for name, f in (("kspec.jax", kspec_fn), ("XLA layer_norm+silu", xla_fn)):
        for mode in ("fwd", "fwd+bwd"):
            g = jax.jit(f) if mode == "fwd" else jax.jit(lambda dy, *a, f=f: jax.vjp(f, *a)[1](dy))
            call = (lambda g=g: g(x, w, bb)) if mode == "fwd" else (lambda g=g: g(dy, x, w, bb))
            row = {"shape": shape, "pass": mode, "variant": name}
            try:
                if mode == "fwd":
                    row["rel_err"] = _rel(np.asarray(call(), np.float32), ref, np)
                row["valid"] = same if name == "kspec.jax" and mode == "fwd" else row.get("rel_err", 0.0) <= tol
                last = [None]
                row.update(_wall_ms(lambda call=call, last=last: last.__setitem__(0, call()),
                                    lambda last=last: jax.block_until_ready(last[0]), ctx.jax_calls, ctx.jax_repeats))
            except Exception as e:  # noqa: BLE001
                row["error"] = short_error(e, 300)
            rows.append(row)
    rows += _norm_host_rows(ctx, jax, jnp, np, kj, kspec_fn, xla_fn, x, w, bb, ref, shape, tol)
    for mode in ("fwd", "fwd+bwd"):
        g = mode == "fwd+bwd"
        a = [t.clone().requires_grad_(g) for t in (tx, tw_, tb)]
        t_dy = torch.from_dlpack(jax.block_until_ready(dy))

        def torch_call(a=a, g=g):
            y = kspec.ops.norm_act(*a, norm="layernorm", act="silu")
            if g:
                y.backward(t_dy)

        rows.append({"shape": shape, "pass": mode, "variant": "kspec torch", "valid": True,
                     **_wall_ms(torch_call, torch.cuda.synchronize, ctx.jax_calls, ctx.jax_repeats)})
    _ratios(rows, shape)
    return rows


def _norm_host_rows(ctx, jax, jnp, np, kj, kspec_fn, xla_fn, x, w, bb, ref, shape, tol):
    """Where a forward call's host time goes (issue 32: kspec.jax's forward was host-bound at 0.113 ms a
    call against torch's 0.100 on the H100, host 0.117 ms): JAX's own cost per call of these arguments (a
    jitted identity, x donated: nothing runs); the same custom call with the statistics written (3
    results); the same handler registered under another name without its initialize stage (XLA then runs
    one FFI stage per execution, not two); and N calls unrolled inside one jit, kspec's and XLA's, per call
    (JAX's dispatch paid once per N: the host ms column is then mostly XLA's thunks and kspec's handler)."""
    from kspec import _C

    rows = []

    def timed(variant, call, steps=1, check="bitwise"):
        row = {"shape": shape, "pass": "fwd", "variant": variant}
        try:
            if check:  # "bitwise": the same kernel as kspec.jax's forward; "tol": another specialization
                row["rel_err"] = _rel(np.asarray(call(), np.float32), ref, np)
                row["valid"] = row["rel_err"] == 0.0 if check == "bitwise" else row["rel_err"] <= tol
            last = [None]
            row.update(_wall_ms(lambda: last.__setitem__(0, call()), lambda: jax.block_until_ready(last[0]),
                                ctx.jax_calls, ctx.jax_repeats, steps))
        except Exception as e:  # noqa: BLE001 (a row, not the end)
            row["error"] = short_error(e, 300)
        rows.append(row)

    box = {"x": x.copy()}  # donated each call and handed back: JAX's dispatch, no kernel
    ident = jax.jit(lambda x, w, b: x, donate_argnums=0)

    def ident_call():
        box["x"] = ident(box["x"], w, bb)
        return box["x"]

    timed("jax.jit identity, same 3 arguments (x donated)", ident_call, check=None)
    params = dict(norm="layernorm", act="silu", eps=np.float64(1e-5))
    y_spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    stats = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    with_stats = jax.jit(lambda x, w, b: jax.ffi.ffi_call("kspec_norm_act_fwd", [y_spec, stats, stats])(
        x, w, b, inputs="x,weight,bias", outputs="y,mean,rstd", **params)[0])
    timed("kspec.jax with mean, rstd (3 results)", lambda: with_stats(x, w, bb), check="tol")
    alias = "kspec_bench_norm_act_fwd_execute_only"
    if alias not in _ALIASES:  # once per process (a second --repeat of the family reuses it)
        jax.ffi.register_ffi_target(alias, _C._xla_handler("kspec_norm_act_fwd"), platform=kj.PLATFORM)
        _ALIASES.add(alias)
    exec_only = jax.jit(lambda x, w, b: jax.ffi.ffi_call(alias, [y_spec])(
        x, w, b, inputs="x,weight,bias", outputs="y", save_stats=np.bool_(False), **params)[0])
    timed("kspec.jax, execute stage only (no initialize)", lambda: exec_only(x, w, bb))
    n = _IN_JIT_STEPS
    for variant, f in ((f"kspec.jax x{n} in one jit, per call", kspec_fn),
                       (f"XLA layer_norm+silu x{n} in one jit, per call", xla_fn)):
        def chain(x, w, b, f=f):
            for _ in range(n):  # unrolled: n custom calls (or fusions), each on the last one's output
                x = f(x, w, b)
            return x

        timed(variant, lambda g=jax.jit(chain): g(x, w, bb), steps=n, check=None)
    return rows


_IN_JIT_STEPS = 10


def _jax_loop_row(jax, ctx, label, variant, fn, params, init, grads, lr, steps):
    """A row for fn(params, grads, state, lr) -> (params, state), jitted with params and state donated, on
    its own copy of the params; `steps` optimizer steps a call (the row is per step)."""
    box = {"p": [p.copy() for p in params]}
    box["s"] = init(box["p"])

    def call():
        box["p"], box["s"] = fn(box["p"], grads, box["s"], lr)

    row = {"shape": label, "pass": "step", "variant": variant}
    try:
        row.update(_wall_ms(call, lambda: jax.block_until_ready(box["p"]), ctx.jax_calls, ctx.jax_repeats, steps))
    except Exception as e:  # noqa: BLE001 (a row, not the end)
        row["error"] = short_error(e, 300)
    return row


def _adamw_section(ctx, jax, jnp, np, kj, torch, kspec):
    from .adamw import gpt350m_shapes

    shapes = gpt350m_shapes() if not ctx.quick else [(1024, 1024), (1024,)] * 8
    rng = np.random.default_rng(ctx.seed + 2)
    params = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    grads = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    h = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    label = f"{len(shapes)} tensors, {sum(int(np.prod(s)) for s in shapes) / 1e6:.1f} M fp32"
    rows = []
    # lr as a training loop has it: a device scalar made once (a schedule computes it inside the step), not
    # a host-to-device copy per call that the torch rows do not make.
    lr = jax.block_until_ready(jnp.float32(1e-3))
    # donated: params and state updated in place, as kspec.optim.AdamW updates torch's; not donated: XLA
    # copies params, exp_avg and exp_avg_sq before the in-place kernel (what an undonated train step pays)
    for donate in (True, False):
        step = jax.jit(lambda p, g, s, lr: kj.adamw_step(p, g, s, lr=lr, **h), donate_argnums=(0, 2) if donate else ())
        # Each variant steps its own copy: a donated argument is deleted, and `params` seeds the peers below.
        box = {"p": [p.copy() for p in params]}
        box["s"] = kj.adamw_init(box["p"])

        def kspec_call(step=step, box=box):
            box["p"], box["s"], _ = step(box["p"], grads, box["s"], lr)

        rows.append({"shape": label, "pass": "step",
                     "variant": "kspec.jax adamw_step" + (" (jit, donated)" if donate else " (jit, not donated)"),
                     **_wall_ms(kspec_call, lambda box=box: jax.block_until_ready(box["p"]), ctx.jax_calls,
                                ctx.jax_repeats)})
    # What is JAX's and what is kspec's: a jitted identity over the same arguments (donated, nothing to run)
    # costs what JAX spends per call on ~4 x 243 arrays; the same step run 10 times inside one jit
    # (fori_loop, params and state carried in place) costs the step's own GPU and handler time, per step.
    n_args = 4 * len(shapes) + 2

    def identity(p, g, s, lr):
        return p, s

    rows += [_jax_loop_row(jax, ctx, label, f"jax.jit identity, same {n_args} arguments (donated)",
                           jax.jit(identity, donate_argnums=(0, 2)), params, kj.adamw_init, grads, lr, 1)]

    def kspec_steps(p, g, s, lr):
        return jax.lax.fori_loop(0, _IN_JIT_STEPS, lambda i, c: kj.adamw_step(c[0], g, c[1], lr=lr, **h)[:2], (p, s))

    rows.append(_jax_loop_row(jax, ctx, label, f"kspec.jax adamw_step x{_IN_JIT_STEPS} in one jit, per step",
                              jax.jit(kspec_steps, donate_argnums=(0, 2)), params, kj.adamw_init, grads, lr,
                              _IN_JIT_STEPS))
    try:
        import optax

        opt = optax.adamw(1e-3, b1=h["beta1"], b2=h["beta2"], eps=h["eps"], weight_decay=h["weight_decay"])
        obox = {"p": [p.copy() for p in params]}
        obox["s"] = opt.init(obox["p"])

        def optax_step(p, g, s):
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s

        optax_step = jax.jit(optax_step, donate_argnums=(0, 2))

        def optax_call():
            obox["p"], obox["s"] = optax_step(obox["p"], grads, obox["s"])

        rows.append({"shape": label, "pass": "step", "variant": "optax.adamw (jit, donated)",
                     **_wall_ms(optax_call, lambda: jax.block_until_ready(obox["p"]), ctx.jax_calls, ctx.jax_repeats)})

        def optax_steps(p, g, s, lr):
            def body(i, c):
                updates, st = opt.update(g, c[1], c[0])
                return optax.apply_updates(c[0], updates), st

            return jax.lax.fori_loop(0, _IN_JIT_STEPS, body, (p, s))

        rows.append(_jax_loop_row(jax, ctx, label, f"optax.adamw x{_IN_JIT_STEPS} in one jit, per step",
                                  jax.jit(optax_steps, donate_argnums=(0, 2)), params, opt.init, grads, lr,
                                  _IN_JIT_STEPS))
    except ImportError as e:
        rows.append({"shape": label, "pass": "step", "variant": "optax.adamw", "error": f"not installed ({e})"})
    tp = [torch.nn.Parameter(torch.from_dlpack(jax.block_until_ready(p.copy()))) for p in params]
    for p, g in zip(tp, grads):
        p.grad = torch.from_dlpack(jax.block_until_ready(g))
    topt = kspec.optim.AdamW(tp, lr=1e-3, betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"])
    rows.append({"shape": label, "pass": "step", "variant": "kspec torch (kspec.optim.AdamW)",
                 **_wall_ms(topt.step, torch.cuda.synchronize, ctx.jax_calls, ctx.jax_repeats)})
    base = rows[0].get("ms")
    for r in rows:
        if base and "ms" in r:
            r["vs_kspec_jax"] = r["ms"] / base
    return rows


def run(ctx):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process
    torch = ctx.torch
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except ImportError as e:
        raise NoGpu(f"jax is not importable ({e})") from None
    try:
        if not jax.devices("cuda"):
            raise RuntimeError
    except RuntimeError:
        raise NoGpu("jax sees no CUDA device") from None
    import kspec.jax as kj

    kspec = ctx.kspec
    cols = [("shape", "shape"), ("pass", "pass"), ("variant", "variant"),
            ("ms", lambda r: fmt(r.get("ms"), ".3f")), ("host ms", lambda r: fmt(r.get("host_ms"), ".3f")),
            ("vs kspec.jax", lambda r: fmt(r.get("vs_kspec_jax"), ".2f")),
            ("rel err", lambda r: fmt(r.get("rel_err"), ".1e")),
            ("check", lambda r: r.get("error") or ("ok" if r.get("valid", True) else "INVALID"))]
    data, sections = {}, []
    for key, title, fn in (("selective_scan", "selective_scan bf16, dstate 16, D z delta_bias softplus", _scan_section),
                           ("norm_act", "norm_act bf16 layernorm+silu", _norm_section),
                           ("adamw", "AdamW step, GPT-350M parameter list", _adamw_section)):
        if ctx.skipped(key):
            continue
        rows = fn(ctx, jax, jnp, np, kj, torch, kspec)
        data[key] = rows
        notes = ["ms: wall clock per call with --jax-calls calls queued back to back, median of --jax-repeats; "
                 "host ms: one call's return on an idle queue (the host's part); kspec.jax's forward must equal "
                 "kspec torch's bit for bit, peers (and the bld rows) kspec within the bf16 tolerance"]
        if key == "norm_act":
            notes.append(f"identity: JAX's own cost per call of these arguments (nothing runs); execute stage only: "
                         f"kspec's handler registered without its initialize stage; x{_IN_JIT_STEPS} rows: one jitted "
                         f"call of {_IN_JIT_STEPS} chained forwards, per forward (host ms: XLA's thunks and kspec's "
                         "handler with JAX's dispatch spread over them)")
        if key == "selective_scan":
            notes.append(f"{BLD_T}: bld_mode='transpose', XLA transposes the bld operands to bdl around the bdl "
                         f"kernels; {BLD_IN}: the time-major kernels reading bld where it lies")
        if key == "adamw":
            notes.append(f"the identity row is JAX's own cost per call of these arguments (nothing runs); the x"
                         f"{_IN_JIT_STEPS} rows are one jitted call of {_IN_JIT_STEPS} steps (fori_loop), per step: "
                         "the step without JAX's per-call cost")
        sections.append(Section(title, cols, rows, notes=notes))
    return data, sections
