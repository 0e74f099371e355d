"""kspec.jax without a GPU: the XLA target table (generated from the registry), the handler capsules, their
registration with jaxlib's XLA at import, and what jitted functions lower to (the custom calls, their
attributes, default row-major layouts in both scan layouts and no copies in the compiled bld module, adamw's aliasing, the backward's targets under jax.grad)."""
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a GPU machine: leave memory to torch

import kspec  # noqa: E402
from kspec import _C, _xla  # noqa: E402

TARGETS = {"kspec_selective_scan_fwd": "selective_scan.fwd", "kspec_selective_scan_bwd": "selective_scan.bwd",
           "kspec_selective_scan_step": "selective_scan.step", "kspec_norm_act_fwd": "norm_act.fwd",
           "kspec_norm_act_bwd": "norm_act.bwd", "kspec_e79_fwd": "e79.fwd", "kspec_e79_bwd": "e79.bwd",
           "kspec_adamw": "adamw"}


def test_target_table_is_the_registry():
    table = _xla.targets()
    assert {t["target"]: t["op"] for t in table} == TARGETS
    for t in table:
        info = kspec.op_info(t["op"])
        assert [o["name"] for o in t["operands"]] == [i["name"] for i in info["inputs"]]
        assert [r["name"] for r in t["results"]] == [o["name"] for o in info["outputs"]]
        attrs = {a["name"]: a["type"] for a in t["attributes"]}
        for p in info["params"]:
            assert p["name"] in attrs, (t["target"], p["name"])
        assert attrs["inputs"] == attrs["outputs"] == "string"
        assert ("layout" in attrs) == (t["op"] in ("selective_scan.fwd", "selective_scan.bwd"))
        assert ("tensors" in attrs) == (t["op"] == "adamw")
    md = _xla.markdown()
    assert md.count("\n| `kspec_") == len(TARGETS)
    assert "| `kspec_norm_act_fwd` | norm_act.fwd | x, weight, *bias* | y, *mean*, *rstd* |" in md


def test_handlers_are_capsules_when_built():
    if not _xla.available():
        assert all(_C._xla_handler(t) is None for t in TARGETS)
        return
    for t in TARGETS:
        assert type(_C._xla_handler(t)).__name__ == "PyCapsule", t
        assert type(_C._xla_handler(t, "initialize")).__name__ == "PyCapsule", t
    assert _C._xla_handler("kspec_no_such_target") is None
    assert _C._xla_handler("kspec_no_such_target", "initialize") is None
    with pytest.raises(kspec.InvalidArgument, match="stage must be"):
        _C._xla_handler("kspec_norm_act_fwd", "instantiate")


def test_import_without_jax_says_why():
    code = ("import sys\nsys.modules['jax'] = None  # as if jax were not installed\n"
            "try:\n    import kspec.jax\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ImportError: kspec.jax needs jax (pip install jax" in r.stdout, (r.stdout, r.stderr)


jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def test_import_says_why_without_the_handlers():
    if _xla.available():
        pytest.skip("this kspec has the XLA handlers")
    with pytest.raises(ImportError, match="without XLA's FFI headers"):
        import kspec.jax  # noqa: F401


@pytest.fixture(scope="module")
def kj():
    if not _xla.available():
        pytest.skip("kspec built without XLA's FFI headers")
    import kspec.jax as kj  # registers every target for CUDA

    return kj


def _hlo(fn, *args, platform="cuda"):
    """The StableHLO text of fn jitted, lowered for `platform` (no device of it needed)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _calls(text):
    """(target, attribute text) of every custom call in a StableHLO module."""
    return re.findall(r'stablehlo.custom_call @(\w+)\(.*?backend_config = \{([^}]*)\}', text)


def test_registered_at_import_for_cuda(kj):
    from jax._src.lib import xla_client

    assert kj.PLATFORM == "CUDA"
    if "CUDA" in xla_client._custom_callback_handler:
        pytest.skip("a CUDA plugin is loaded: registrations went straight to it (the GPU tests run them)")
    # Without the CUDA plugin, jaxlib keeps CUDA registrations until the plugin loads: every target is
    # there once, with the typed FFI (api_version 1) and kspec._C's handlers for two stages: initialize
    # (validates and compiles before the execution) and execute.
    pending = {name: (fn, api) for name, fn, api, _ in xla_client._custom_callback.get("CUDA", [])}
    for t in TARGETS:
        fn, api = pending[t]
        assert api == 1 and sorted(fn) == ["execute", "initialize"], t
        assert all(type(h).__name__ == "PyCapsule" for h in fn.values()), t


def test_xla_binds_the_handler(tmp_path):
    """XLA itself decodes a kspec handler's binding: registered for the CPU it gets as far as the CUDA
    stream, which a CPU has not (the body needs a GPU: test_gpu_jax.py)."""
    if not _xla.available():
        pytest.skip("kspec built without XLA's FFI headers")
    code = (
        "import jax, jax.numpy as jnp\n"
        "from kspec import _C\n"
        "jax.ffi.register_ffi_target('kspec_norm_act_fwd', _C._xla_handler('kspec_norm_act_fwd'), platform='cpu')\n"
        "import kspec.jax as kj\n"
        "x = jnp.ones((4, 64)); w = jnp.ones((64,))\n"
        "try:\n"
        "    jax.jit(lambda x, w: kj.norm_act(x, w))(x, w).block_until_ready()\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "ERROR" in r.stdout and "platform stream" in r.stdout, (r.stdout, r.stderr)


def test_norm_act_lowers_to_the_custom_call_and_its_backward(kj):
    x = jax.ShapeDtypeStruct((6, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64,), jnp.float32)
    text = _hlo(lambda x, w: kj.norm_act(x, w, norm="rmsnorm", act="silu", eps=1e-6), x, w)
    [(target, attrs)] = _calls(text)
    assert target == "kspec_norm_act_fwd"
    # without a gradient the statistics are not asked for (torch's path skips them too)
    assert 'inputs = "x,weight"' in attrs and 'outputs = "y"' in attrs and "save_stats = false" in attrs
    assert 'norm = "rmsnorm"' in attrs and 'act = "silu"' in attrs and "eps = 9.9999999999999995E-7 : f64" in attrs
    grad = _hlo(jax.grad(lambda x, w: kj.norm_act(x, w).astype(jnp.float32).sum(), argnums=(0, 1)), x, w)
    assert [t for t, _ in _calls(grad)] == ["kspec_norm_act_fwd", "kspec_norm_act_bwd"]
    assert 'inputs = "dy,x,weight,mean,rstd"' in grad and 'outputs = "dx,dweight"' in grad
    assert 'outputs = "y,mean,rstd"' in grad


@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_selective_scan_lowers_with_layouts_and_backward(kj, layout):
    b, d, L, n = 2, 8, 5, 4
    seq = (b, d, L) if layout == "bdl" else (b, L, d)
    bc = (b, n, L) if layout == "bdl" else (b, L, n)
    S = jax.ShapeDtypeStruct
    args = (S(seq, jnp.bfloat16), S(seq, jnp.bfloat16), S((d, n), jnp.float32), S(bc, jnp.bfloat16),
            S(bc, jnp.bfloat16), S((d,), jnp.float32))

    def loss(u, delta, A, B, C, D):
        return kj.selective_scan(u, delta, A, B, C, D, delta_softplus=True, layout=layout,
                                 bld_mode="in_place").astype(jnp.float32).sum()

    text = _hlo(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), *args)
    calls = _calls(text)
    assert [t for t, _ in calls] == ["kspec_selective_scan_fwd", "kspec_selective_scan_bwd"]
    fwd, bwd = calls[0][1], calls[1][1]
    assert f'layout = "{layout}"' in fwd and "delta_softplus = true" in fwd
    assert 'inputs = "u,delta,A,B,C,D"' in fwd and 'outputs = "out,last_state,states"' in fwd
    assert 'outputs = "du,ddelta,dA,dB,dC,dD"' in bwd
    assert 'inputs = "dout,u,delta,A,B,C,D,dlast_state,states"' in bwd
    fwd_line = next(line for line in text.splitlines() if "@kspec_selective_scan_fwd" in line)
    # Both layouts take XLA's default row-major buffers (the handler hands bld buffers to the op's layout
    # "bld", whose kernels read them in place): every operand and result layout of both calls is the
    # default (minor-to-major [rank-1, ..., 0]), so XLA adds no transposes around them (the compiled
    # module: test_selective_scan_bld_compiles_without_copies).
    for line in text.splitlines():
        if "@kspec_selective_scan" in line:
            for dims in re.findall(r"dense<\[([\d, ]+)\]>", line):
                order = [int(x) for x in dims.split(",")]
                assert order == sorted(order, reverse=True), line
    assert "stablehlo.transpose" not in text
    # states: [batch, dim, ceil(seqlen / 16), dstate] fp32
    assert f"tensor<{b}x{d}x1x{n}xf32>" in fwd_line
    # 3-D B and C are operands as given: no reshape (under XLA a copy kernel each) in front of the call
    assert f"tensor<{bc[0]}x{bc[1]}x{bc[2]}xbf16>" in fwd_line and "stablehlo.reshape" not in text, text


def test_selective_scan_bld_compiles_without_copies():
    """Layout "bld" (Nx's [batch, seqlen, dim]) is read where it lies: XLA's compiled module of a jitted
    forward + backward has no copy or transpose anywhere, as for "bdl". The CPU compiler runs the layout
    assignment and copy insertion passes the GPU's does; the handlers are registered for the CPU only to
    compile (in a subprocess: nothing runs). Asking XLA for bdl operand layouts instead gave 10 copies."""
    if not _xla.available():
        pytest.skip("kspec built without XLA's FFI headers")
    code = textwrap.dedent("""
        import re, jax, jax.numpy as jnp
        from kspec import _C, _xla
        for t in _xla.targets():
            stages = {s: _C._xla_handler(t["target"], s) for s in ("initialize", "execute")}
            jax.ffi.register_ffi_target(t["target"], stages, platform="cpu")
        import kspec.jax as kj
        S = jax.ShapeDtypeStruct
        b, d, L, n, g = 2, 8, 5, 4, 2
        for layout in ("bdl", "bld"):  # B one group (3-D), C two groups (4-D)
            seq, B, C = (((b, d, L), (b, n, L), (b, g, n, L)) if layout == "bdl" else
                         ((b, L, d), (b, L, n), (b, L, g, n)))
            args = (S(seq, jnp.bfloat16), S(seq, jnp.bfloat16), S((d, n), jnp.float32), S(B, jnp.bfloat16),
                    S(C, jnp.bfloat16), S((d,), jnp.float32), S(seq, jnp.bfloat16))
            def loss(u, delta, A, B, C, D, z):
                out = kj.selective_scan(u, delta, A, B, C, D, z, delta_softplus=True, layout=layout,
                                        bld_mode="in_place")
                return out.astype(jnp.float32).sum()
            hlo = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*args).lower().compile().as_text()
            calls = len(re.findall(r'custom_call_target="kspec_selective_scan_(?:fwd|bwd)"', hlo))
            moves = re.findall(r" (copy|transpose)\\(", hlo)
            print(layout, "calls", calls, "moves", len(moves))
        """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bdl calls 2 moves 0" in r.stdout and "bld calls 2 moves 0" in r.stdout, (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("groups", [None, 2])
def test_selective_scan_bld_transpose_runs_the_bdl_call(kj, groups):
    """bld_mode="transpose": XLA transposes the bld operands to bdl (B/C 3-D and 4-D), the
    custom calls run layout "bdl" on them (forward and backward), and out and the gradients come back in
    bld's order; bld_mode="in_place" (the default) calls layout "bld" on the buffers as they lie."""
    b, d, L, n = 2, 8, 5, 4
    S = jax.ShapeDtypeStruct
    bc = (b, L, n) if groups is None else (b, L, groups, n)
    args = (S((b, L, d), jnp.bfloat16), S((b, L, d), jnp.bfloat16), S((d, n), jnp.float32), S(bc, jnp.bfloat16),
            S(bc, jnp.bfloat16), S((d,), jnp.float32), S((b, L, d), jnp.bfloat16))

    def fwd(u, delta, A, B, C, D, z):
        return kj.selective_scan(u, delta, A, B, C, D, z, delta_softplus=True, layout="bld", bld_mode="transpose")

    out = jax.eval_shape(fwd, *args)
    assert out.shape == (b, L, d) and out.dtype == jnp.bfloat16
    grads = jax.eval_shape(jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=tuple(range(7))), *args)
    assert [g.shape for g in grads] == [a.shape for a in args]
    text = _hlo(jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=tuple(range(7))), *args)
    calls = _calls(text)
    assert [t for t, _ in calls] == ["kspec_selective_scan_fwd", "kspec_selective_scan_bwd"]
    assert all('layout = "bdl"' in attrs for _, attrs in calls)
    fwd_line = next(line for line in text.splitlines() if "@kspec_selective_scan_fwd" in line)
    assert f"tensor<{b}x{d}x{L}xbf16>" in fwd_line  # u as bdl
    assert ((f"tensor<{b}x{n}x{L}xbf16>" if groups is None else f"tensor<{b}x{groups}x{n}x{L}xbf16>")
            in fwd_line)
    assert "stablehlo.transpose" in text
    in_place = _hlo(lambda *a: kj.selective_scan(*a[:5], a[5], a[6], layout="bld"), *args)  # the default
    assert "stablehlo.transpose" not in in_place and 'layout = "bld"' in in_place


def test_e79_and_step_lower(kj):
    T, B, n = 3, 2, 8
    kvqm = jax.ShapeDtypeStruct((T, B, 4 * n), jnp.float32)
    bias = jax.ShapeDtypeStruct((n,), jnp.float32)
    text = _hlo(jax.grad(lambda x, bs, bm: kj.e79_cell(x, n, bs, bm, chunk=4)[0].sum(), argnums=(0, 1, 2)),
                kvqm, bias, bias)
    calls = _calls(text)
    assert [t for t, _ in calls] == ["kspec_e79_fwd", "kspec_e79_bwd"]
    assert 'inputs = "k,v,q,m,b_s,b_m"' in calls[0][1] and "chunk = 4 : i64" in calls[0][1]
    assert 'outputs = "dk,dv,dq,dm,db_s,db_m"' in calls[1][1]
    S = jax.ShapeDtypeStruct
    step = _hlo(lambda s, u, dt, A, Bm, Cm: kj.selective_scan_step(s, u, dt, A, Bm, Cm),
                S((2, 8, 4), jnp.float32), S((2, 8), jnp.float32), S((2, 8), jnp.float32), S((8, 4), jnp.float32),
                S((2, 4), jnp.float32), S((2, 4), jnp.float32))
    assert "output_operand_aliases" in step and "@kspec_selective_scan_step" in step


def test_adamw_lowers_in_place(kj):
    params = {"w": jnp.zeros((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
    state = kj.adamw_init(params)
    assert state.master is not None and state.max_exp_avg_sq is None and int(state.step) == 0
    text = _hlo(lambda p, g, s, lr: kj.adamw_step(p, g, s, lr=lr, weight_decay=0.1, max_norm=1.0), params, params,
                state, jnp.float32(1e-3))
    [(target, attrs)] = _calls(text)
    assert target == "kspec_adamw"
    # lr and the step are device scalars the kernel reads (no host read-back in the handler)
    assert 'inputs = "device_lr,device_step,params,grads,exp_avg,exp_avg_sq,master"' in attrs
    assert "lr =" not in attrs and "step =" not in attrs
    assert 'outputs = "params,exp_avg,exp_avg_sq,master,grad_norm"' in attrs and "tensors = 2 : i64" in attrs
    # every in-place list's buffers alias their operands: 4 lists x 2 tensors
    assert text.count("output_tuple_indices") == 8


def test_adamw_step_outside_jit_is_one_jit_donating_on_request(kj):
    """Outside jit, adamw_step runs one jitted step of its own: with donate=True every params and state
    buffer is donated to the result it becomes (no copy before the in-place kernel); by default none is
    (the caller's arrays stay valid; XLA copies). Under jit, donate=True is refused: it cannot apply."""
    params = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    state = kj.adamw_init(params)
    hyper = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, maximize=False, max_norm=0.0)

    def lowered(donate):
        return kj._adamw_step_jit(donate).trace(params, params, state, 1e-3, None, **hyper).lower(
            lowering_platforms=("cuda",)).as_text()

    donated = lowered(True)
    # params (2), exp_avg (2), exp_avg_sq (2) and the step count, each aliased to its result
    assert donated.count("tf.aliasing_output") == 7, donated[:2000]
    assert "tf.aliasing_output" not in lowered(False)
    with pytest.raises(ValueError, match="donate=True under jit"):
        jax.jit(lambda p, g, s: kj.adamw_step(p, g, s, donate=True)).trace(params, params, state)


def test_bad_layout_is_refused_before_lowering(kj):
    x = jnp.zeros((1, 2, 3))
    with pytest.raises(ValueError, match="layout must be 'bdl' or 'bld'"):
        kj.selective_scan(x, x, jnp.zeros((2, 4)), x, x, layout="lbd")
    with pytest.raises(ValueError, match="bld_mode must be one of"):
        kj.selective_scan(x, x, jnp.zeros((2, 4)), x, x, layout="bld", bld_mode="copy")
    with pytest.raises(ValueError, match="kvqm must be"):
        kj.e79_cell(jnp.zeros((2, 2, 7)), 2)


def test_table_json_is_the_c_table():
    assert json.loads(_C._xla_targets()) == _xla.targets()


def test_readme_table_is_generated():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert _xla.markdown() in readme, "README's target table is stale: paste `python -m kspec._xla`"


def test_adamw_transformation_init_and_update(kj):
    """kspec.jax.adamw: optax's (init, update) pair; update lowers to the one fused custom call, with the
    schedule's learning rate as an operand, and returns updates shaped like the params (fp32 for 16-bit)."""
    tx = kj.adamw(lambda count: 1e-3 / (1 + count), weight_decay=0.1)
    assert isinstance(tx, tuple) and tx._fields == ("init", "update")
    params = {"w": jnp.zeros((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
    state = tx.init(params)
    assert isinstance(state, kj.AdamWState) and int(state.step) == 0 and state.master is not None
    assert jax.tree_util.tree_structure(state.exp_avg) == jax.tree_util.tree_structure(params)
    updates, new_state = jax.eval_shape(tx.update, params, state, params)
    assert {k: (v.shape, v.dtype) for k, v in updates.items()} == {"w": ((4, 3), jnp.float32),
                                                                  "b": ((3,), jnp.float32)}
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    [(target, attrs)] = _calls(_hlo(tx.update, params, state, params))
    assert target == "kspec_adamw" and 'inputs = "device_lr,device_step,params,grads,exp_avg,exp_avg_sq,master"' in attrs


def test_adamw_transformation_errors(kj):
    with pytest.raises(ValueError, match="b1 must be in"):
        kj.adamw(1e-3, b1=1.0)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        kj.adamw(1e-3, eps=-1.0)
    with pytest.raises(ValueError, match="learning_rate must be >= 0"):
        kj.adamw(-1e-3)
    tx = kj.adamw()
    params = {"w": jnp.zeros((3,), jnp.float32)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))
    with pytest.raises(TypeError, match="AdamWState"):
        tx.update(params, {"count": 0}, params)
