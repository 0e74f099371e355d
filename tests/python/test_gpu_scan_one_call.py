"""selective_scan's one C++ call (call_grad and its C++ node) on the GPU: the outputs and gradients of the
autograd.Function on the pure path (no extension) — bitwise, but a variable B/C's gradients, which the backward
sums over channels with fp32 atomics (an order that differs from run to run: run 33 saw it at 3x37x129), within
the dtype's tolerance — for every way a training step meets the node: h0 and its gradient, a used and
an unused last_state, a broadcast or transposed dout, fixed B/C, no D/z/delta_bias, inputs that want no
gradient, and the shapes of issue 33's table. The CPU twin (host path on the mock driver) is
test_scan_one_call.py."""
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _native  # noqa: E402
from helpers import TOL, rel_err  # noqa: E402
from test_gpu_torch_ext import _np, pure_path  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_native.ext is None, reason="the torch extension is not loaded")]


def _inputs(b, d, t, fixed_bc=False, optional=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    rn = lambda *s, dt=bf: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    u, z = rn(b, d, t), rn(b, d, t)
    delta = rn(b, d, t).abs() * 0.1
    A = -(0.25 + torch.rand(d, 16, device="cuda", generator=g))
    B, C = (rn(d, 16, dt=torch.float32), rn(d, 16, dt=torch.float32)) if fixed_bc else (rn(b, 1, 16, t), rn(b, 1, 16, t))
    D, db, h0 = rn(d, dt=torch.float32), rn(d, dt=torch.float32) * 0.1, rn(b, d, 16, dt=torch.float32)
    return [u, delta, A, B, C] + ([D, z, db, h0] if optional else [None, None, None, None])


_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")


def _step(inputs, wanted, loss):
    """(the node of out, {name: tensor} of out, last_state and the gradients of the inputs that want one)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(w) for t, w in zip(inputs, wanted)]
    u, delta, A, B, C, D, z, db, h0 = leaves
    out, last = kspec.ops.selective_scan_fn(u, delta, A, B, C, D, z, db, True, return_last_state=True, h0=h0)
    node = out.grad_fn
    names = [n for n, t in zip(_NAMES, leaves) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss(out, last), [leaves[_NAMES.index(n)] for n in names])
    return node, dict(out=out, last_state=last, **{"d" + n: g for n, g in zip(names, grads)})


def _same(got, want, what):
    assert got.keys() == want.keys(), what
    for k, a in got.items():
        b = want[k]
        assert a.shape == b.shape and a.dtype == b.dtype, (what, k)
        if k in ("dB", "dC") and b.dim() == 4:  # a variable B/C's: fp32 atomics over channels
            assert rel_err(_np(a), _np(b)) <= TOL["bfloat16"], (what, k)
        else:
            assert torch.equal(a, b), (what, k)


_LOSSES = {
    "out": lambda out, last: out.float().square().sum(),
    "out and last_state": lambda out, last: out.float().square().sum() + last.square().sum(),
    "last_state only": lambda out, last: last.sum(),  # dout zeros, a broadcast dlast_state
    "broadcast dout": lambda out, last: out.sum(),
    # the gradient of a [batch, seqlen, dim] view comes back transposed: a non-contiguous dout
    "transposed dout": lambda out, last: out.transpose(1, 2).float().square().sum(),
}


@pytest.mark.parametrize("loss", list(_LOSSES))
@pytest.mark.parametrize("shape", [(2, 64, 300), (1, 40, 1), (3, 37, 129)])
def test_one_call_node_gives_the_functions_outputs_and_gradients(shape, loss):
    inputs = _inputs(*shape)
    wanted = [True] * 9
    node, got = _step(inputs, wanted, _LOSSES[loss])
    assert not isinstance(node, torch.autograd.function.BackwardCFunction) and node.name() == "SelectiveScanBackward"
    with pure_path():
        want_node, want = _step(inputs, wanted, _LOSSES[loss])
        assert isinstance(want_node, torch.autograd.function.BackwardCFunction)
    _same(got, want, f"scan {shape} {loss}")


@pytest.mark.parametrize("variant", ["fixed B/C", "no optional inputs", "some inputs want no gradient",
                                     "h0 without gradient"])
def test_one_call_node_variants(variant):
    inputs = _inputs(2, 48, 200, fixed_bc=variant == "fixed B/C", optional=variant != "no optional inputs")
    wanted = [True] * 9
    if variant == "some inputs want no gradient":
        wanted = [True, False, False, True, False, True, False, False, True]
    if variant == "h0 without gradient":
        wanted[8] = False
    node, got = _step(inputs, wanted, _LOSSES["out and last_state"])
    assert not isinstance(node, torch.autograd.function.BackwardCFunction)
    with pure_path():
        _, want = _step(inputs, wanted, _LOSSES["out and last_state"])
    _same(got, want, f"scan {variant}")


@pytest.mark.parametrize("shape", [(1, 2048, 512), (2, 4096, 333), (16, 768, 256)])
def test_one_call_node_at_issue_33_shapes(shape):
    """The small shapes of issue 33's table, where the forward takes the tile, sequential and wide kernels and the
    backward the segments' plan at 1x2048x512: the node's `states` (allocated in C++) read by each."""
    inputs = _inputs(*shape, optional=True)
    inputs[8] = None  # the Mamba-1 call: no h0
    node, got = _step(inputs, [True] * 9, _LOSSES["out"])
    with pure_path():
        _, want = _step(inputs, [True] * 9, _LOSSES["out"])
    _same(got, want, f"scan {shape}")
