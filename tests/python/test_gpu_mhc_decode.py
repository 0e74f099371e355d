"""mhc.pre.fwd's algo=decode (4) and decode_rows (5), the one-launch forward for few tokens, from Python on a GPU:
against the float64 NumPy reference, save_stats=False (no inv, no h; the other outputs the same bits), the same bits
at every call and from decode_rows, and torch.cuda.graph replays giving the eager bits."""
import pytest

from helpers import TOL, load_reference, max_rel, mhc_layer_inputs, to_np, torch_or_skip

import kspec

ref = load_reference("mhc")


DECODE = "algo=4,threads=256,tokens=1"
DECODE_ROWS = "algo=5,threads=256,tokens=1"  # the projection's warps split phi's rows: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("T,n,D", [(1, 4, 4096), (8, 4, 4096), (33, 3, 4000), (2, 8, 4096)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_decode_algo_matches_reference_without_saved_stats_too(T, n, D, dtype_name):
    """mhc.pre.fwd at algo=decode on [1, T, n, D]: every output against the float64 reference (fp32 outputs 1e-5:
    exact fp32 FMAs); with save_stats=False inv and h are absent (None) and the other outputs the same bits; a
    second call the same bits again, and algo=decode_rows too."""
    t = torch_or_skip()
    dtype = getattr(t, dtype_name)
    x, phi, alpha, bias, gam = mhc_layer_inputs(1, T, n, D, dtype, seed=T * 10 + n)
    outs = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=DECODE)
    want = ref.mhc_pre_fwd(to_np(x).reshape(T, n, D), to_np(phi), to_np(alpha), to_np(bias), to_np(gam))
    for name, got in zip(("y", "h_pre", "h_post", "r", "inv", "h"), outs):
        tol = TOL[dtype_name] if name == "y" else 1e-5
        assert max_rel(got.reshape(want[name].shape), want[name]) <= tol, name
    lean = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=DECODE, save_stats=False)
    assert lean[4] is None and lean[5] is None
    for a, b in zip(outs[:4], lean[:4]):
        assert t.equal(a, b)
    for config in (DECODE, DECODE_ROWS):
        again = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=config)
        for a, b in zip(outs, again):
            assert t.equal(a, b), config


@pytest.mark.gpu
def test_decode_algo_in_a_cuda_graph_replays_the_eager_bits():
    """torch.cuda.graph captures kspec.call at algo=decode (its counters zeroed by a memset node in the graph and
    left zero by the kernel); two replays into poisoned outputs give the eager call's bits, and so does an eager
    call after them (the stream's own counters untouched)."""
    t = torch_or_skip()
    x, phi, alpha, bias, gam = mhc_layer_inputs(1, 8, 4, 4096, t.bfloat16, seed=7)
    eager = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=DECODE, save_stats=False)[:4]
    outs = tuple(t.empty_like(o) for o in eager)
    kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=DECODE, save_stats=False,
               out=outs + (None, None))  # warm: nothing to compile or load inside the capture
    t.cuda.synchronize()
    g = t.cuda.CUDAGraph()
    with t.cuda.graph(g):
        kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=DECODE, save_stats=False, out=outs + (None, None))
    for _ in range(2):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        t.cuda.synchronize()
        for a, b in zip(outs, eager):
            assert t.equal(a, b)
    again = kspec.call("mhc.pre.fwd", x, phi, alpha, bias, gam, config=DECODE, save_stats=False)[:4]
    for a, b in zip(again, eager):
        assert t.equal(a, b)
