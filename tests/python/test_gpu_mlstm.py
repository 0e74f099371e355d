"""mlstm on the GPU through kspec.call: the named regression fp16_S64_seed0 of issue 29 (the recipe that
gave a user's CUDA mLSTM a NaN at S = 64 from the order of a rescale), forward and backward of the
chunkwise and the parallel form against the float64 reference of the same fp16 inputs."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import mlstm as ref  # noqa: E402

pytestmark = pytest.mark.gpu


def _np(t):
    return t.detach().double().cpu().numpy()


def _rel_max(out, want):
    out = _np(out)
    assert np.all(np.isfinite(out)), "non-finite values"
    return float(np.abs(out - want).max() / np.abs(want).max())


def _seed0_inputs():
    """B = NH = 1, S = 64, DH = 32; torch.manual_seed(0); q, k, v, i, f, dh = randn on CUDA in that
    order, cast to fp16 (issue 29's recipe, exactly)."""
    torch.manual_seed(0)
    B, NH, S, DH = 1, 1, 64, 32
    q, k, v = (torch.randn(B, NH, S, DH, device="cuda") for _ in range(3))
    i, f = (torch.randn(B, NH, S, device="cuda") for _ in range(2))
    dh = torch.randn(B, NH, S, DH, device="cuda")
    return [t.half() for t in (q, k, v, i, f, dh)]


def _nan_like(t, dtype=None):
    return torch.full_like(t, float("nan"), dtype=dtype)


def _inputs(B, NH, S, DK, DV, dtype, seed, grad=False):
    """Random inputs on CUDA from a generator seeded `seed`, drawn in this order: q, k, v (B, NH, S, DK / DV),
    i, f + 2 (B, NH, S) in `dtype`; then the forward's fp32 C0 (B, NH, DK, DV), n0 (B, NH, DK), m0 (B, NH, 1):
    (q, k, v, i, f, C0, n0, m0); with grad, dh (B, NH, S, DV) in `dtype` first and dC_last (like C0) last, n0
    zero (the backward has no n0: the forward's nrm is its constant, and the reference's is from n0 = 0):
    (q, k, v, i, f, dh, C0, n0, m0, dC_last)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = r(B, NH, S, DK).to(dtype), r(B, NH, S, DK).to(dtype), r(B, NH, S, DV).to(dtype)
    i, f = r(B, NH, S).to(dtype), (r(B, NH, S) + 2.0).to(dtype)
    if not grad:
        return q, k, v, i, f, r(B, NH, DK, DV), r(B, NH, DK), r(B, NH, 1)
    dh = r(B, NH, S, DV).to(dtype)
    C0, n0, m0, dC_last = r(B, NH, DK, DV), torch.zeros(B, NH, DK, device="cuda"), r(B, NH, 1), r(B, NH, DK, DV)
    return q, k, v, i, f, dh, C0, n0, m0, dC_last


def _fwd(q, k, v, i, f, C0, n0, m0, chunk, config):
    """mlstm.chunkwise.fwd from initial states with every output NaN-poisoned first: (h, nrm, m_rows,
    C_last, n_last, m_last)."""
    rows = _nan_like(i, torch.float32)
    out = (_nan_like(v), rows.clone(), rows.clone(), _nan_like(C0), _nan_like(n0), _nan_like(m0))
    kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, C0, n0, m0, out=out, chunk=chunk, config=config)
    return out


def _bwd(q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, chunk, config):
    """mlstm.chunkwise.bwd with every gradient NaN-poisoned first: (dq, dk, dv, di, df, dC0)."""
    out = (_nan_like(q), _nan_like(k), _nan_like(v), _nan_like(i), _nan_like(f), _nan_like(C0))
    kspec.call("mlstm.chunkwise.bwd", q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, out=out, chunk=chunk,
               config=config)
    return out


@pytest.mark.parametrize("form", ["chunkwise", "parallel"])
def test_fp16_S64_seed0(form):
    q, k, v, i, f, dh = _seed0_inputs()
    rows = _nan_like(i, torch.float32)
    h, nrm, m_rows = _nan_like(v), rows.clone(), rows.clone()
    if form == "chunkwise":
        kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, None, None, None,
                   out=(h, nrm, m_rows, None, None, None), chunk=64)
    else:
        kspec.call("mlstm.parallel.fwd", q, k, v, i, f, out=(h, nrm, m_rows))
    grads = [_nan_like(q), _nan_like(k), _nan_like(v), _nan_like(i), _nan_like(f)]
    if form == "chunkwise":
        kspec.call("mlstm.chunkwise.bwd", q, k, v, i, f, None, None, nrm, m_rows, dh, None,
                   out=(*grads, None), chunk=64)
    else:
        kspec.call("mlstm.parallel.bwd", q, k, v, i, f, nrm, m_rows, dh, out=tuple(grads))
    torch.cuda.synchronize()
    x = [_np(t) for t in (q, k, v, i, f)]
    if form == "chunkwise":
        want_h, want_nrm, want_m, _ = ref.mlstm_chunkwise_fwd(*x, chunk=64)
        want = ref.mlstm_chunkwise_bwd(_np(dh), *x, chunk=64)
    else:
        want_h, want_nrm, want_m = ref.mlstm_parallel_fwd(*x)
        want = ref.mlstm_parallel_bwd(_np(dh), *x)
    assert _rel_max(h, want_h) <= 3e-3  # the fp16 forward tolerance
    assert _rel_max(nrm, want_nrm) <= 1e-4 and _rel_max(m_rows, want_m) <= 1e-4  # fp32 in the kernels
    for name, g in zip(("dq", "dk", "dv", "di", "df"), grads):
        assert _rel_max(g, want[name]) <= 1e-2, name  # the fp16 gradient tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S,chunk", [(1, 64), (2, 16), (65, 64), (100, 32), (300, 128)])
def test_tensor_core_forward(dtype, S, chunk):
    """mlstm.chunkwise.fwd algo=tc (templates/mlstm/chunkwise_tc.cuh) from initial states, every output
    against the float64 reference of the same rounded inputs (h and the last states within the issue's
    forward tolerance, nrm and m in fp32 math within 1e-4), and h against algo=simt's."""
    B, NH, DK, DV = 1, 2, 32, 64
    q, k, v, i, f, C0, n0, m0 = _inputs(B, NH, S, DK, DV, dtype, S + chunk)

    def run(config):
        return _fwd(q, k, v, i, f, C0, n0, m0, chunk, config)

    h, nrm, m, C, n, m_last = run("algo=tc,threads=128")
    h_simt = run("algo=simt,threads=256")[0]
    torch.cuda.synchronize()
    want_h, want_nrm, want_m, (want_C, want_n, want_m_last) = ref.mlstm_chunkwise_fwd(
        *(_np(t) for t in (q, k, v, i, f, C0, n0)), _np(m0).reshape(B, NH), chunk=chunk)
    tol = 3e-3 if dtype == torch.float16 else 2e-2  # the forward tolerance
    assert _rel_max(h, want_h) <= tol
    assert _rel_max(C, want_C) <= tol and _rel_max(n, want_n) <= tol
    assert _rel_max(nrm, want_nrm) <= 1e-4 and _rel_max(m, want_m) <= 1e-4
    assert _rel_max(m_last, want_m_last.reshape(B, NH, 1)) <= 1e-4
    assert _rel_max(h, _np(h_simt)) <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S,chunk", [(1, 64), (2, 16), (65, 64), (150, 32), (300, 128)])
def test_tensor_core_backward(dtype, S, chunk):
    """mlstm.chunkwise.bwd algo=tc (templates/mlstm/chunkwise_tc_bwd.cuh) after the forward, with initial
    states and dC_last: every gradient against the float64 reference of the same rounded inputs within
    the issue's gradient tolerance, and against algo=simt's."""
    B, NH, DK, DV = 1, 2, 32, 64
    q, k, v, i, f, dh, C0, n0, m0, dC_last = _inputs(B, NH, S, DK, DV, dtype, 10 * S + chunk, grad=True)
    rows = _nan_like(i, torch.float32)
    nrm, m_rows = rows.clone(), rows.clone()
    kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, C0, n0, m0, out=(_nan_like(v), nrm, m_rows, None, None, None),
               chunk=chunk)

    def run(config):
        return _bwd(q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, chunk, config)

    got, simt = run("algo=tc,threads=128"), run("algo=simt,threads=256")
    torch.cuda.synchronize()
    want = ref.mlstm_chunkwise_bwd(*(_np(t) for t in (dh, q, k, v, i, f, C0, n0)), _np(m0).reshape(B, NH),
                                   _np(dC_last), chunk=chunk)
    tol = 1e-2 if dtype == torch.float16 else 5e-2  # the gradient tolerance
    for name, x, y in zip(("dq", "dk", "dv", "di", "df", "dC0"), got, simt):
        assert _rel_max(x, want[name].reshape(x.shape)) <= tol, name
        assert _rel_max(x, _np(y)) <= tol, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("S", [1, 65, 300])
@pytest.mark.parametrize("DK,DV,algo", [(32, 64, "tc_merged"), (128, 128, "tc_merged"), (64, 256, "tc_merged"),
                                        (256, 512, "tc_merged"), (256, 512, "tc_stream")])
def test_tensor_core_merged_backward(DK, DV, algo, S, chunk, dtype):
    """algo=tc_merged (both state scans in one launch; dq, dv and dk of a tile as consecutive CTAs of one
    launch; at DHQK 256 dv looping over DHQK's blocks) and tc_stream (DHQK 256: dq and dk streaming DHHV's
    blocks, all three in one launch) over several sequences (B = 2, NH = 3: each CTA finds its sequence and
    tile from its role), with initial states and dC_last: every gradient against the float64 reference
    within the issue's tolerance and within it of algo=tc's, and a second call bitwise equal."""
    if DK > 128 and (S == 1 or chunk == 128 or dtype == torch.float16):
        pytest.skip("256 x 512: S 65 and 300 at chunk 64 in bf16 (test_tensor_core_large_head_dims has the rest)")
    B, NH = 2, 3
    q, k, v, i, f, dh, C0, n0, m0, dC_last = _inputs(B, NH, S, DK, DV, dtype, S + DK + DV + chunk, grad=True)
    rows = _nan_like(i, torch.float32)
    nrm, m_rows = rows.clone(), rows.clone()
    kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, C0, n0, m0, out=(_nan_like(v), nrm, m_rows, None, None, None),
               chunk=chunk, config="algo=tc,threads=128")

    def run(algo):
        return _bwd(q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, chunk, f"algo={algo},threads=128")

    got, again, tc = run(algo), run(algo), run("tc")
    torch.cuda.synchronize()
    want = ref.mlstm_chunkwise_bwd(*(_np(t) for t in (dh, q, k, v, i, f, C0, n0)), _np(m0).reshape(B, NH),
                                   _np(dC_last), chunk=chunk)
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    for name, x, y, z in zip(("dq", "dk", "dv", "di", "df", "dC0"), got, again, tc):
        assert _rel_max(x, want[name].reshape(x.shape)) <= tol, name
        assert _rel_max(x, _np(z)) <= tol, f"{name} vs algo=tc"
        assert torch.equal(x, y), f"{name}: a second call differs"


@pytest.mark.parametrize("S,chunk", [(1, 64), (65, 16), (300, 16), (2100, 64), (4100, 128), (700, 256)])
def test_tensor_core_forward_gates_by_warps(S, chunk):
    """algo=tc_pg (the gates kernel by 16 warps, one chunk each per round; the m carried between chunks walked
    from shared memory): every output of the forward bitwise equal to algo=tc's (the same expressions), from
    initial states, bf16, over several sequences; S from 1 to 4100 (1 to 3 rounds of 16 chunks, the last one
    partial, chunks cut by S)."""
    B, NH, DK, DV, dtype = 2, 3, 32, 64, torch.bfloat16
    q, k, v, i, f, C0, n0, m0 = _inputs(B, NH, S, DK, DV, dtype, S + chunk)
    got = _fwd(q, k, v, i, f, C0, n0, m0, chunk, "algo=tc_pg,threads=128")
    tc = _fwd(q, k, v, i, f, C0, n0, m0, chunk, "algo=tc,threads=128")
    torch.cuda.synchronize()
    for name, a, b in zip(("h", "nrm", "m_rows", "C_last", "n_last", "m_last"), got, tc):
        assert torch.equal(a, b), name
    want_h = ref.mlstm_chunkwise_fwd(*(_np(t) for t in (q, k, v, i, f, C0, n0)), _np(m0).reshape(B, NH),
                                     chunk=chunk)[0]
    assert _rel_max(got[0], want_h) <= 2e-2


@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("S", [1, 65, 300, 520])
@pytest.mark.parametrize("DK,DV", [(32, 64), (64, 64), (128, 128)])
def test_tensor_core_overlap_backward(DK, DV, S, chunk):
    """algo=tc_overlap (tc_merged's kernels with each gradient CTA's next tiles requested while it computes:
    key tiles (dq) and query tiles (dv, dk) double-buffered through C's and dC's buffers at 128 x 128; the
    gates kernel by warps), tc_wide_pg (tc_wide with the gates kernel by warps) and
    tc_wide_overlap (with tc_wide's state tiles) over several sequences, bf16, with initial states and
    dC_last: every gradient bitwise equal to tc_merged's (tc_wide's), and within the issue's tolerance of the
    float64 reference. Chunk 256 walks 4 key tiles (the buffers in turn), S = 65, 300 and 520 end inside a
    tile."""
    B, NH, dtype = 2, 3, torch.bfloat16
    q, k, v, i, f, dh, C0, n0, m0, dC_last = _inputs(B, NH, S, DK, DV, dtype, S + DK + DV + chunk, grad=True)
    _, nrm, m_rows = _fwd(q, k, v, i, f, C0, n0, m0, chunk, "algo=tc,threads=128")[:3]
    pairs = [("tc_overlap", "tc_merged")]
    if DK >= 128 and chunk <= 128:
        pairs += [("tc_wide_overlap", "tc_wide"), ("tc_wide_pg", "tc_wide")]
    want = ref.mlstm_chunkwise_bwd(*(_np(t) for t in (dh, q, k, v, i, f, C0, n0)), _np(m0).reshape(B, NH),
                                   _np(dC_last), chunk=chunk)
    for algo, base in pairs:
        got, same = (_bwd(q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, chunk, f"algo={a},threads=128")
                     for a in (algo, base))
        torch.cuda.synchronize()
        for name, x, y in zip(("dq", "dk", "dv", "di", "df", "dC0"), got, same):
            assert torch.equal(x, y), f"{algo} {name} vs {base}"
            assert _rel_max(x, want[name].reshape(x.shape)) <= 5e-2, f"{algo} {name}"


@pytest.mark.parametrize("algo", ["tc_q128", "tc_wide_q128"])
@pytest.mark.parametrize("chunk", [128, 256])
@pytest.mark.parametrize("S", [1, 65, 200, 300])
@pytest.mark.parametrize("DK,DV", [(32, 64), (128, 128), (256, 512)])
def test_tensor_core_forward_128_query_rows(DK, DV, S, chunk, algo):
    """The forward's output kernel on 128 query rows a CTA (algo=tc_q128; tc_wide_q128 with tc_wide's state
    tiles) over several sequences (B = 2, NH = 3), from initial states, bf16: h, nrm, m and the last states
    against the float64 reference and algo=tc's, a second call bitwise equal. S = 65 and 200 end inside a
    CTA's first or second half (its warps past S, and at chunk 256 the upper CTA of a chunk), 300 spans
    chunks."""
    if algo == "tc_wide_q128" and (chunk > 128 or DK < 128):
        pytest.skip("tc_wide: head dims >= 128 and chunk <= 128")
    B, NH, dtype = 2, 3, torch.bfloat16
    q, k, v, i, f, C0, n0, m0 = _inputs(B, NH, S, DK, DV, dtype, S + DK + DV + chunk)

    def fwd(config):
        return _fwd(q, k, v, i, f, C0, n0, m0, chunk, config)

    got, again, tc = fwd(f"algo={algo},threads=128"), fwd(f"algo={algo},threads=128"), fwd("algo=tc,threads=128")
    torch.cuda.synchronize()
    want_h, want_nrm, want_m, (want_C, want_n, _) = ref.mlstm_chunkwise_fwd(
        *(_np(t) for t in (q, k, v, i, f, C0, n0)), _np(m0).reshape(B, NH), chunk=chunk)
    for name, a, b, c, w, tol in zip(("h", "nrm", "m_rows", "C_last", "n_last", "m_last"), got, again, tc,
                                     (want_h, want_nrm, want_m, want_C, want_n, None),
                                     (2e-2, 1e-4, 1e-4, 2e-2, 2e-2, 1e-4)):
        if w is not None:
            assert _rel_max(a, w.reshape(a.shape)) <= tol, name
        assert _rel_max(a, _np(c)) <= tol, f"{name} vs algo=tc"
        assert torch.equal(a, b), f"{name}: a second call differs"


@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("S", [1, 65, 300])
@pytest.mark.parametrize("DK,DV", [(128, 128), (128, 256), (256, 512)])
def test_tensor_core_wide_state_tiles(DK, DV, S, chunk):
    """algo=tc_wide (the state scans on 128 x 128 tiles of C, 8 warps: forward and both scans of the
    backward) over several sequences (B = 2, NH = 3) with initial states and dC_last, bf16: h, the last
    states and every gradient against the float64 reference, within the issue's tolerance of algo=tc's
    (forward) and the default's (backward), and a second call bitwise equal."""
    if DK > 128 and S == 1:
        pytest.skip("256 x 512: S 65 and 300 (the tiles' rows and chunks; S = 1 at the smaller dims)")
    B, NH, dtype = 2, 3, torch.bfloat16
    q, k, v, i, f, dh, C0, n0, m0, dC_last = _inputs(B, NH, S, DK, DV, dtype, S + DK + DV + chunk, grad=True)

    def fwd(config):
        return _fwd(q, k, v, i, f, C0, n0, m0, chunk, config)

    wide, wide2, tc = fwd("algo=tc_wide,threads=128"), fwd("algo=tc_wide,threads=128"), fwd("algo=tc,threads=128")
    torch.cuda.synchronize()
    x = [_np(t) for t in (q, k, v, i, f, C0, n0)]
    want_h, _, _, (want_C, want_n, _) = ref.mlstm_chunkwise_fwd(*x, _np(m0).reshape(B, NH), chunk=chunk)
    for name, a, b, c, w in zip(("h", "nrm", "m_rows", "C_last", "n_last", "m_last"), wide, wide2, tc,
                                (want_h, None, None, want_C, want_n, None)):
        if w is not None:
            assert _rel_max(a, w.reshape(a.shape)) <= 2e-2, name
        assert _rel_max(a, _np(c)) <= 2e-2, f"{name} vs algo=tc"
        assert torch.equal(a, b), f"{name}: a second call differs"
    _, nrm, m_rows = wide[:3]

    def bwd(config):
        return _bwd(q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, chunk, config)

    got, again, default = bwd("algo=tc_wide,threads=128"), bwd("algo=tc_wide,threads=128"), bwd(None)
    torch.cuda.synchronize()
    want = ref.mlstm_chunkwise_bwd(_np(dh), *x, _np(m0).reshape(B, NH), _np(dC_last), chunk=chunk)
    for name, a, b, c in zip(("dq", "dk", "dv", "di", "df", "dC0"), got, again, default):
        assert _rel_max(a, want[name].reshape(a.shape)) <= 5e-2, name
        assert _rel_max(a, _np(c)) <= 5e-2, f"{name} vs the default"
        assert torch.equal(a, b), f"{name}: a second call differs"


@pytest.mark.parametrize("algo", ["tc", "tc_fused", "tc_parts", "tc_merged", "tc_stream"])
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("S", [1, 65, 300])
@pytest.mark.parametrize("DK,DV", [(128, 256), (256, 512)])
def test_tensor_core_large_head_dims(DK, DV, S, chunk, algo):
    """Issue 29's larger head dims on the tensor-core kernels, bf16, with initial states and dC_last: the
    forward's h and the backward's gradients (column blocks of 128, partials summed in a fixed order;
    tc_fused: dv and dk in one kernel; tc_parts: dq and dk by column blocks too, where tc loops over DHHV's
    blocks; tc_merged: tc's CTAs in fewer launches at DHQK 128, dv looping over DHQK's blocks at 256;
    tc_stream: dq and dk streaming DHHV's blocks at DHQK 256, their dots q . dq, k . dk in two parts) against
    the float64 reference, and a second backward bitwise equal."""
    if algo == "tc_parts" and DK > 128:
        pytest.skip("algo=tc_parts differs from algo=tc only at DHQK <= 128 < DHHV")
    if algo == "tc_stream" and DK <= 128:
        pytest.skip("algo=tc_stream differs from algo=tc_merged only at DHQK > 128")
    B, NH, dtype = 1, 1, torch.bfloat16
    q, k, v, i, f, dh, C0, n0, m0, dC_last = _inputs(B, NH, S, DK, DV, dtype, S + DK + chunk, grad=True)
    h, nrm, m_rows = _nan_like(v), _nan_like(i, torch.float32), _nan_like(i, torch.float32)
    kspec.call("mlstm.chunkwise.fwd", q, k, v, i, f, C0, n0, m0, out=(h, nrm, m_rows, None, None, None), chunk=chunk,
               config="algo=tc,threads=128")

    def run():
        return _bwd(q, k, v, i, f, C0, m0, nrm, m_rows, dh, dC_last, chunk, f"algo={algo},threads=128")

    got, again = run(), run()
    torch.cuda.synchronize()
    x = [_np(t) for t in (q, k, v, i, f, C0, n0)]
    want_h = ref.mlstm_chunkwise_fwd(*x, _np(m0).reshape(B, NH), chunk=chunk)[0]
    assert _rel_max(h, want_h.reshape(h.shape)) <= 2e-2, "h"
    want = ref.mlstm_chunkwise_bwd(_np(dh), *x, _np(m0).reshape(B, NH), _np(dC_last), chunk=chunk)
    for name, a, b in zip(("dq", "dk", "dv", "di", "df", "dC0"), got, again):
        assert _rel_max(a, want[name].reshape(a.shape)) <= 5e-2, name
        assert torch.equal(a, b), f"{name}: a second call differs"


@pytest.mark.parametrize("config", [None, "algo=split,threads=256,cols=64", "algo=block,threads=256,cols=16"])
@pytest.mark.parametrize("B,NH,DK,DV", [(1, 8, 128, 128), (1, 2, 256, 256), (3, 2, 64, 16)])
def test_step_in_place_matches_the_recurrence(B, NH, DK, DV, config):
    """mlstm.step in place (C, n, m updated where they are read), the default (algo=split: a gates kernel,
    then CTAs over column slabs of C) and the first kernel (algo=block), bf16 q/k/v, fp32 states, two steps
    in a row against the float64 recurrence; B = 1 and head dims 64-256 (the default: slabs of 8 columns, 1-2
    passes)."""
    if config and "cols=64" in config and DV < 64:
        config = "algo=split,threads=64,cols=16"
    g = torch.Generator(device="cuda").manual_seed(DK + DV)
    rn = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    C, n, m = rn(B, NH, DK, DV), rn(B, NH, DK).abs(), rn(B, NH, 1)
    steps = [(rn(B, NH, DK), rn(B, NH, DK), rn(B, NH, DV), rn(B, NH, 1), rn(B, NH, 1) + 3) for _ in range(2)]
    steps = [tuple(t.bfloat16() for t in s) for s in steps]
    x = [np.stack([_np(s[j]) for s in steps], axis=2) for j in range(5)]  # [B, NH, 2, D] / [B, NH, 2, 1]
    want_h, _, _, (want_C, want_n, want_m) = ref.mlstm_recurrent_fwd(
        x[0], x[1], x[2], x[3][..., 0], x[4][..., 0], _np(C), _np(n), _np(m)[..., 0])
    for t, (q, k, v, i, f) in enumerate(steps):
        h = _nan_like(v)
        kspec.call("mlstm.step", q, k, v, i, f, C, n, m, out=(h, C, n, m), config=config)
        torch.cuda.synchronize()
        assert _rel_max(h, want_h[:, :, t]) < 2e-2, t
    assert _rel_max(C, want_C) < 1e-5
    assert _rel_max(n, want_n) < 1e-5
    assert _rel_max(m, want_m[..., None]) < 1e-6


@pytest.mark.parametrize("algo", ["head", "cluster"])
@pytest.mark.parametrize("B,NH,DK,DV,threads", [(64, 8, 128, 128, 512), (8, 8, 128, 128, 256), (2, 3, 64, 128, 128),
                                                (1, 2, 128, 256, 512)])
def test_step_head_and_cluster_equal_split(B, NH, DK, DV, threads, algo):
    """mlstm.step algo=head (one CTA per sequence, the scalars formed in it, one launch) and algo=cluster
    (split's slabs of 32 columns forming the scalars themselves, a sequence's slabs one cluster; sm_90+) in
    place, two steps: C', n', m' bitwise equal to algo=split's (the same fmas; cluster: h too, the same
    sums), h within the bf16 tolerance of split's and of the float64 recurrence."""
    if algo == "cluster" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("algo=cluster needs thread-block clusters (sm_90 or newer)")
    g = torch.Generator(device="cuda").manual_seed(B + DK + DV)
    rn = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    C, n, m = rn(B, NH, DK, DV), rn(B, NH, DK).abs(), rn(B, NH, 1)
    steps = [tuple(t.bfloat16() for t in (rn(B, NH, DK), rn(B, NH, DK), rn(B, NH, DV), rn(B, NH, 1), rn(B, NH, 1) + 3))
             for _ in range(2)]
    x = [np.stack([_np(s[j]) for s in steps], axis=2) for j in range(5)]
    want_h, _, _, (want_C, want_n, want_m) = ref.mlstm_recurrent_fwd(
        x[0], x[1], x[2], x[3][..., 0], x[4][..., 0], _np(C), _np(n), _np(m)[..., 0])
    states = {name: (C.clone(), n.clone(), m.clone()) for name in (algo, "split")}
    split_threads = min(256, DK * 8)  # slabs of 32 columns, at most 64 floats of C a thread
    configs = {"head": f"algo=head,threads={threads},cols=16",
               "cluster": f"algo=cluster,threads={split_threads},cols=32",
               "split": f"algo=split,threads={split_threads},cols=32"}
    for t, (q, k, v, i, f) in enumerate(steps):
        hs = {}
        for name, s in states.items():
            hs[name] = _nan_like(v)
            kspec.call("mlstm.step", q, k, v, i, f, *s, out=(hs[name], *s), config=configs[name])
        torch.cuda.synchronize()
        assert _rel_max(hs[algo], want_h[:, :, t]) < 2e-2, t
        assert _rel_max(hs[algo], _np(hs["split"])) < 2e-2, t
        if algo == "cluster":
            assert torch.equal(hs[algo], hs["split"]), t
    for name, a, b in zip(("C", "n", "m"), states[algo], states["split"]):
        assert torch.equal(a, b), name
    assert _rel_max(states[algo][0], want_C) < 1e-5
    assert _rel_max(states[algo][1], want_n) < 1e-5

