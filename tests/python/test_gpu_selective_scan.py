"""selective_scan on the GPU through Python: forward and every gradient (autograd, h0 and the last
state's gradient included) against the float64 reference for every dtype, fixed and variable B/C,
groups, each optional input on and off, dstate 1..256, T=1, T=2, odd and tile-multiple lengths and
a 65536-step sequence; the forward's tile and wide kernels at their edges; the decode step against the
reference and against the scan; torch.compile."""
import numpy as np
import pytest

from helpers import TOL, rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference import selective_scan as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32 over long recurrences (ex2.approx decays, fp32 sums over batch and time): OpDef::tolerance_scale.
SCALE = 4.0

# name: (batch, dim, seqlen, dstate, B/C form, options)
#   form: "var4" (batch, groups, dstate, seqlen), "var3" (batch, dstate, seqlen), "fixed", "fixed_b"
BASE = dict(batch=2, dim=24, seqlen=300, dstate=16, groups=1, form="var4", D=True, z=True, bias=True,
            softplus=True, h0=True, dlast=True)
VARIANTS = {
    "base": {},
    "seqlen_1": dict(seqlen=1),
    "seqlen_2": dict(seqlen=2, softplus=False),
    "seqlen_1023": dict(seqlen=1023),
    "seqlen_1024_even": dict(seqlen=1024),
    "seqlen_4097": dict(batch=1, dim=8, seqlen=4097),
    "dim_37": dict(dim=37, seqlen=129),
    "dstate_1": dict(dstate=1),
    "dstate_4": dict(dstate=4),
    "dstate_64": dict(dstate=64),
    "dstate_256": dict(dim=8, dstate=256, seqlen=100),
    "groups_4": dict(groups=4, dim=32, seqlen=257),
    "bc_3d": dict(form="var3"),
    "fixed_bc": dict(form="fixed"),
    "fixed_b": dict(form="fixed_b", groups=2),
    "no_D": dict(D=False),
    "no_z": dict(z=False),
    "no_delta_bias": dict(bias=False),
    "no_softplus": dict(softplus=False),
    "no_h0": dict(h0=False),
    "no_dlast": dict(dlast=False),
    "nothing_optional": dict(D=False, z=False, bias=False, softplus=False, h0=False, dlast=False),
    # few channels and long: the heuristic cuts the sequence into segments run in parallel
    "segments_fixed_bc": dict(batch=2, dim=16, seqlen=9000, form="fixed"),
    "segments_groups_4": dict(batch=1, dim=32, groups=4, seqlen=8200, softplus=False),
    # batch * dim >= 8192: the sequential-state kernels (the variants above take the warp scan)
    "wide_8x1024": dict(batch=8, dim=1024, seqlen=130),
    # 1024..8191 channels, 128 steps or more: algo 1 at 2 states per thread with segments (backward: 4
    # here; forward from 1024 steps: 8), where the warp scan ran before
    "few_channels_short_1x1024x600": dict(batch=1, dim=1024, seqlen=600),
    "few_channels_short_1x1024x1100": dict(batch=1, dim=1024, seqlen=1100, h0=False),
    # 2048 channels, seqlen a multiple of 512: the heuristic's forward is the tile kernel (16-bit dtypes)
    "tile_heuristic_4x512x1024": dict(batch=4, dim=512, seqlen=1024),
    # the forward keeps no states (save_states=False): the backward recomputes them, with each algorithm
    "no_saved_states": dict(save=False),
    "no_saved_states_wide": dict(batch=8, dim=1024, seqlen=130, save=False),
    "no_saved_states_segments": dict(batch=2, dim=16, seqlen=9000, form="fixed", save=False),
}


def _np(t):
    return None if t is None else t.detach().double().cpu().numpy()


def _inputs(dtype, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, d, T, N, G = v["batch"], v["dim"], v["seqlen"], v["dstate"], v["groups"]

    def rn(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32).to(dt)

    u = rn(b, d, T)
    # dt >= 0 and A < 0 keep the recurrence a decay (Mamba's regime)
    delta = rn(b, d, T) if v["softplus"] else (0.05 + 0.5 * rn(b, d, T, dt=torch.float32).abs()).to(dtype)
    A = -(0.25 + rn(d, N, dt=torch.float32).abs())
    var_shape = (b, G, N, T) if v["form"] in ("var4", "fixed_b") else (b, N, T)
    B = rn(d, N) if v["form"] in ("fixed", "fixed_b") else rn(*var_shape)
    C = rn(d, N) if v["form"] == "fixed" else rn(*var_shape)
    D = rn(d, dt=torch.float32) if v["D"] else None
    z = rn(b, d, T) if v["z"] else None
    bias = None
    if v["bias"]:
        bias = rn(d, dt=torch.float32) if v["softplus"] else 0.1 * rn(d, dt=torch.float32).abs()
    h0 = rn(b, d, N, dt=torch.float32) if v["h0"] else None
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=bias, h0=h0)


def _tol(dtype):
    return TOL[str(dtype).split(".")[1]] * SCALE


def _run_and_check(dtype, v, seed=0):
    x = _inputs(dtype, v, seed)
    leaves = {k: t.clone().requires_grad_() for k, t in x.items() if t is not None}
    args = {k: leaves.get(k) for k in x}
    out, last = kspec.ops.selective_scan_fn(args["u"], args["delta"], args["A"], args["B"], args["C"], D=args["D"],
                                            z=args["z"], delta_bias=args["delta_bias"],
                                            delta_softplus=v["softplus"], return_last_state=True, h0=args["h0"],
                                            save_states=v.get("save", True))
    assert out.dtype == dtype and out.shape == x["u"].shape
    assert last.dtype == torch.float32 and last.shape == (v["batch"], v["dim"], v["dstate"])
    dout = torch.randn_like(out)
    dlast = torch.randn_like(last) if v["dlast"] else None
    torch.autograd.backward([out, last] if v["dlast"] else [out], [dout, dlast] if v["dlast"] else [dout])

    np_in = {k: _np(t) for k, t in x.items()}
    kw = dict(D=np_in["D"], z=np_in["z"], delta_bias=np_in["delta_bias"], delta_softplus=v["softplus"], h0=np_in["h0"])
    out_r, last_r = ref.selective_scan_fwd(np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"], **kw)
    grads_r = ref.selective_scan_bwd(_np(dout), np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                     dlast_state=_np(dlast), **kw)
    tol = _tol(dtype)
    errs = {"out": rel_err(_np(out), out_r), "last_state": rel_err(_np(last), last_r)}
    for name, key in [("u", "du"), ("delta", "ddelta"), ("A", "dA"), ("B", "dB"), ("C", "dC"), ("D", "dD"),
                      ("z", "dz"), ("delta_bias", "ddelta_bias"), ("h0", "dh0")]:
        if name in leaves:
            grad = leaves[name].grad
            assert grad is not None and grad.shape == leaves[name].shape, name
            errs[key] = rel_err(_np(grad), grads_r[key])
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_and_gradients_match_reference(dtype, name):
    v = dict(BASE, **VARIANTS[name])
    _run_and_check(dtype, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_long_sequence_65536(dtype):
    v = dict(BASE, batch=1, dim=4, seqlen=65536)
    _run_and_check(dtype, v)


def _heuristic_config(op, **shape):
    """The config text kspec.explain gives for a bf16 call of this shape (the BASE options)."""
    x = _inputs(torch.bfloat16, dict(BASE, **shape))
    args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")]
    if op == "bwd":
        args = [torch.randn_like(x["u"])] + args + [None]
    return str(kspec.explain(f"selective_scan.{op}", *args, delta_softplus=True))


@pytest.mark.parametrize("op", ["fwd", "bwd"])
@pytest.mark.parametrize("shape,pattern,segs", [
    # few channels and a long sequence: segments (the segments_* variants run it)
    (dict(batch=2, dim=16, seqlen=9000, form="fixed"), r"algo=sequential,[0-9a-z=,]*segs=(\d+)", None),
    # 1024 channels, 1100 steps: 2 states per thread and 8 segments (the few_channels variants run it)
    (dict(batch=1, dim=1024, seqlen=1100), r"algo=sequential,[0-9a-z=,]*lanes=8,[0-9a-z=,]*segs=(\d+)", 8),
], ids=["long_narrow", "few_channels_short"])
def test_heuristic_takes_segments(op, shape, pattern, segs):
    import re

    text = _heuristic_config(op, **shape)
    m = re.search(pattern, text)
    assert m and (int(m.group(1)) == segs if segs else int(m.group(1)) > 1), text


def test_segmented_forward_back_to_back_and_in_graph_replays():
    """With segments the forward's main pass starts beside the local pass (programmatic dependent launch on
    sm_90) and waits on a flag per segment, zeroed before each call: calls back to back on new inputs, and
    a captured call replayed on new inputs, each match the float64 reference (a flag left set by the call
    before would let a main block fold a segment's state before the local pass writes it)."""
    v = dict(BASE, batch=1, dim=64, seqlen=16384, h0=False)
    cfg = "algo=sequential,warps=4,items=4,lanes=2,chunk=32,segs=16"
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")
    tol = _tol(torch.bfloat16)

    def check(x, out):
        np_in = {k: _np(t) for k, t in x.items()}
        out_r, _ = ref.selective_scan_fwd(np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"], D=np_in["D"],
                                          z=np_in["z"], delta_bias=np_in["delta_bias"], delta_softplus=True)
        err = rel_err(_np(out), out_r)
        assert err <= tol, (err, tol)

    static = _inputs(torch.bfloat16, v, seed=1)
    fresh = [_inputs(torch.bfloat16, v, seed=s) for s in (2, 3)]
    outs = [kspec.call("selective_scan.fwd", *(x[k] for k in names), config=cfg, delta_softplus=True)[0]
            for x in [static] + fresh]
    for x, out in zip([static] + fresh, outs):
        check(x, out)
    # kspec's workspace is per stream: a first call on the capture stream sizes it.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kspec.call("selective_scan.fwd", *(static[k] for k in names), config=cfg, delta_softplus=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = kspec.call("selective_scan.fwd", *(static[k] for k in names), config=cfg, delta_softplus=True)[0]
    for x in fresh:
        for k in names:
            if static[k] is not None:
                static[k].copy_(x[k])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(x, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("name", ["base", "seqlen_1", "seqlen_1023", "dstate_256", "fixed_b", "wide_8x1024",
                                  "segments_fixed_bc"])
def test_forward_states_match_reference(dtype, name):
    """selective_scan.fwd's `states` (the backward's input in training): the state entering steps 0, 16,
    32, ... against the float64 reference, poisoned before the call so an unwritten entry shows."""
    v = dict(BASE, **VARIANTS[name])
    _forward_states_checked(dtype, v, _inputs(dtype, v))


def _forward_states_checked(dtype, v, x, config=None):
    """selective_scan.fwd with `states` into outputs poisoned with NaN, then out, last_state and states
    against the float64 reference. Returns the call's args, out, last_state and states, the inputs as
    numpy and the reference's keyword arguments (for a backward from those states)."""
    args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")]
    # the raw op takes variable B/C as [batch, groups, dstate, seqlen]: a 3-d one (selective_scan_fn's
    # form) is its one group
    args[3:5] = [t.unsqueeze(1) if t.dim() == 3 else t for t in args[3:5]]
    B_, D_, T, N = v["batch"], v["dim"], v["seqlen"], v["dstate"]
    out = torch.full_like(x["u"], float("nan"))
    last = torch.full((B_, D_, N), float("nan"), device="cuda")
    states = torch.full((B_, D_, -(-T // 16), N), float("nan"), device="cuda")
    kspec.call("selective_scan.fwd", *args, config=config, delta_softplus=v["softplus"], out=(out, last, states))
    np_in = {k: _np(t) for k, t in x.items()}
    kw = dict(D=np_in["D"], z=np_in["z"], delta_bias=np_in["delta_bias"], delta_softplus=v["softplus"], h0=np_in["h0"])
    out_r, last_r, states_r = ref.selective_scan_fwd(np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                                     state_stride=16, **kw)
    tol = _tol(dtype)
    for what, got, want in (("out", out, out_r), ("last_state", last, last_r), ("states", states, states_r)):
        err = rel_err(_np(got), want)
        assert err <= tol, (what, err, tol)
    return args, out, last, states, np_in, kw


TILE_VARIANTS = {
    # dim 20: the last block of 8 channels holds 4; 2048 steps: a partial last tile at 6 warps (96 steps)
    "tile_partial": dict(dim=20, seqlen=2048),
    "tile_fixed_bc_no_h0": dict(dim=16, seqlen=1024, form="fixed", h0=False),
    "tile_groups_2_no_z": dict(dim=32, groups=2, seqlen=1536, z=False, softplus=False),
    # the carry over 683 tiles at 6 warps (a partial last one) and 1024 at 4 warps
    "tile_long_65536": dict(batch=1, dim=8, seqlen=65536),
    # seqlen a multiple of 8 only: the last run of 16 steps ends after 8 (1000, 520) or in the first tile
    "tile_seqlen_1000": dict(dim=24, seqlen=1000),
    "tile_seqlen_520_no_h0": dict(dim=16, seqlen=520, h0=False),
    "tile_seqlen_8": dict(dim=8, seqlen=8),
    # issue 33's shape (at 8 warps: 8 tiles of 64 steps, the odd warps' runs write no `states`)
    "tile_issue_1x2048x512": dict(batch=1, dim=2048, seqlen=512),
    # 3 groups of 4 channels: lanes=8's blocks of 4 channels each read their own group's B/C (lanes=1's blocks
    # of 8 would span two groups: refused, skipped)
    "tile_dim_12_groups_3": dict(dim=12, groups=3, seqlen=256),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", list(TILE_VARIANTS))
@pytest.mark.parametrize("warps,lanes,items",
                         [(4, 1, 4), (6, 1, 4), (8, 1, 4), (2, 8, 4), (4, 8, 4), (4, 1, 8), (4, 1, 16)],
                         ids=["w4", "w6", "w8", "w2_l8", "w4_l8", "w4_lean", "w4_lean2"])
def test_tile_kernel_forward_states_and_backward(dtype, name, warps, lanes, items):
    """The one-pass tile kernel (algo=tile; lanes=8: 2 states a lane, 4 channels a block, 2 or 4 warps; items=8,
    16: the lean kernels, test_scan_tile_lean.py): out, last_state and `states` against the float64 reference
    (poisoned first), then selective_scan.bwd from those states: every gradient against the reference."""
    v = dict(BASE, **TILE_VARIANTS[name])
    if v["dim"] // v["groups"] < (8 if lanes == 1 else 4):
        pytest.skip("a block's channels would span two B/C groups (the config is refused)")
    cfg = f"algo=tile,warps={warps},items={items},lanes={lanes},chunk=32,segs=1"
    args, out, last, states, np_in, kw = _forward_states_checked(dtype, v, _inputs(dtype, v), config=cfg)
    tol = _tol(dtype)
    dout = torch.randn_like(out)
    dlast = torch.randn_like(last)
    grads = kspec.call("selective_scan.bwd", dout, *args, dlast, states, delta_softplus=v["softplus"])
    grads_r = ref.selective_scan_bwd(_np(dout), np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                     dlast_state=_np(dlast), **kw)
    for key, got in zip(("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dh0"), grads):
        if got is not None and grads_r.get(key) is not None:
            err = rel_err(_np(got).reshape(grads_r[key].shape), grads_r[key])
            assert err <= tol, (key, err, tol)


def test_tile_kernel_is_the_heuristic_for_2048_channels():
    """2048 channels over a long sequence in bf16: the heuristic takes the one-pass tile kernel (algo=tile)
    where the sequential kernel would need segments; fp32 (whose prefetch would spill there) does not."""
    v = dict(BASE, batch=1, dim=2048, seqlen=8192)
    for dtype, tile in ((torch.bfloat16, True), (torch.float32, False)):
        x = _inputs(dtype, v)
        args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")]
        text = str(kspec.explain("selective_scan.fwd", *args, delta_softplus=True))
        assert ("config: algo=tile," in text) == tile, text


WIDE_VARIANTS = {
    # dim 20: one block of 32 (or 64) channels holds 20; 264 steps: a last chunk of 8 steps, half a state stride
    "wide_partial": dict(dim=20, seqlen=264),
    "wide_fixed_bc_no_h0": dict(dim=40, seqlen=64, form="fixed", h0=False),
    # a fixed B beside a variable C: one variable tensor's rows staged; 2 groups of 64 channels
    "wide_fixed_b": dict(dim=128, groups=2, seqlen=96, form="fixed_b"),
    "wide_groups_2_no_z": dict(dim=128, groups=2, seqlen=136, z=False, softplus=False),
    "wide_bc_3d_no_D": dict(dim=24, seqlen=48, form="var3", D=False, bias=False),
    # the shortest sequences it takes (one chunk, partial) and many chunks
    "wide_seqlen_8": dict(dim=8, seqlen=8),
    "wide_seqlen_16": dict(dim=8, seqlen=16, h0=False),
    "wide_seqlen_1000": dict(dim=24, seqlen=1000),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", list(WIDE_VARIANTS))
@pytest.mark.parametrize("warps", [4, 8])
def test_wide_kernel_forward_states_and_backward(dtype, name, warps):
    """The wide kernel (algo=wide): out, last_state and `states` against the float64 reference (poisoned
    first), then selective_scan.bwd from those states: every gradient against the reference."""
    v = dict(BASE, **WIDE_VARIANTS[name])
    cfg = f"algo=wide,warps={warps},items=4,lanes=1,chunk=32,segs=1"
    args, out, last, states, np_in, kw = _forward_states_checked(dtype, v, _inputs(dtype, v), config=cfg)
    tol = _tol(dtype)
    dout = torch.randn_like(out)
    dlast = torch.randn_like(last)
    grads = kspec.call("selective_scan.bwd", dout, *args, dlast, states, delta_softplus=v["softplus"])
    grads_r = ref.selective_scan_bwd(_np(dout), np_in["u"], np_in["delta"], np_in["A"], np_in["B"], np_in["C"],
                                     dlast_state=_np(dlast), **kw)
    for key, got in zip(("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dh0"), grads):
        if got is not None and grads_r.get(key) is not None:
            err = rel_err(_np(got).reshape(grads_r[key].shape), grads_r[key])
            assert err <= tol, (key, err, tol)


# Issue 33's small Mamba-1 shapes' channel counts (batch x dim) at a short length, and 16x768x256 itself.
WIDE_ISSUE_SHAPES = [(4, 1536, 72), (2, 4096, 72), (1, 2048, 72), (16, 768, 72), (8, 2560, 72), (16, 768, 256)]


@pytest.mark.parametrize("shape", WIDE_ISSUE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("warps", [4, 8])
def test_wide_kernel_at_the_issue_shapes_channel_counts(shape, warps):
    """bf16, the Mamba-1 call (variable B/C, D, z, delta_bias, softplus, h0): out, last_state and states of
    the wide kernel against the float64 reference."""
    b, d, t = shape
    v = dict(BASE, batch=b, dim=d, seqlen=t)
    _forward_states_checked(torch.bfloat16, v, _inputs(torch.bfloat16, v),
                            config=f"algo=wide,warps={warps},items=4,lanes=1,chunk=32,segs=1")


def test_wide_kernel_is_the_heuristic_for_short_sequences_of_many_channels():
    """12288 channels of 256 steps (issue 33's 16x768x256) in bf16: the heuristic's forward is the wide
    kernel, and its outputs match the reference; not in fp32, nor where seqlen is not a multiple of 8
    (or is 1 or 2: the config is refused with its reason)."""
    for dtype, seqlen, wide in ((torch.bfloat16, 256, True), (torch.float32, 256, False),
                                (torch.bfloat16, 260, False), (torch.bfloat16, 2, False)):
        v = dict(BASE, batch=16, dim=768, seqlen=seqlen)
        x = _inputs(dtype, v)
        args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")]
        text = str(kspec.explain("selective_scan.fwd", *args, delta_softplus=True))
        assert ("config: algo=wide," in text) == wide, text
        if wide:
            _forward_states_checked(dtype, v, x)
    for seqlen in (1, 2):
        v = dict(BASE, dim=40, seqlen=seqlen)
        x = _inputs(torch.bfloat16, v)
        args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")]
        with pytest.raises(ValueError, match="algo=wide needs seqlen a multiple of 8"):
            kspec.call("selective_scan.fwd", *args, config="algo=wide,warps=4,items=4,lanes=1,chunk=32,segs=1",
                       delta_softplus=True)


def test_backward_with_states_of_another_length_is_refused():
    x = _inputs(torch.float32, dict(BASE))
    args = [x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")]
    states = torch.zeros(2, 24, 300 // 16, 16, device="cuda")  # 18, not ceil(300 / 16) = 19
    with pytest.raises(ValueError, match="'states': expected 19 states"):
        kspec.call("selective_scan.bwd", torch.randn_like(x["u"]), *args, None, states, delta_softplus=True)


def test_forward_without_last_state_and_numpy_free_path():
    x = _inputs(torch.bfloat16, dict(BASE))
    out = kspec.ops.selective_scan_fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"],
                                      True)
    assert torch.is_tensor(out) and out.shape == x["u"].shape


def test_variable_bc_accumulators_are_zero_for_every_backward():
    """The backward's variable dB/dC accumulators are a buffer per stream that the reduce kernel leaves zero
    for the next call (no zeroing launch): backward after backward on one stream, the buffer grown by a
    larger problem and read again by smaller ones, B or C alone variable, a second stream; each gradient
    against the float64 reference (a sum left over from the call before would show in dB/dC)."""
    runs = [dict(), dict(), dict(batch=4, dim=64, seqlen=1100, h0=False), dict(), dict(form="fixed_b", groups=2),
            dict(form="var3", seqlen=77), dict(batch=1, dim=1024, seqlen=600)]
    for i, r in enumerate(runs):
        _run_and_check(torch.bfloat16, dict(BASE, **r), seed=i)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            _run_and_check(torch.float32, dict(BASE), seed=10 + i)
    torch.cuda.current_stream().wait_stream(side)


def test_backward_is_deterministic_except_variable_bc():
    v = dict(BASE, form="fixed", dim=64, seqlen=777)
    x = _inputs(torch.float32, v)
    dout = torch.randn_like(x["u"])
    grads = []
    for _ in range(2):
        leaves = {k: t.clone().requires_grad_() for k, t in x.items() if t is not None}
        out = kspec.ops.selective_scan_fn(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"],
                                          leaves["D"], leaves["z"], leaves["delta_bias"], True, h0=leaves["h0"])
        out.backward(dout)
        grads.append({k: t.grad.clone() for k, t in leaves.items()})
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("form", ["var2", "var3", "fixed"])
@pytest.mark.parametrize("dstate", [1, 16, 256])
def test_decode_step_matches_scan(dtype, form, dstate):
    b, d, T = 3, 40, 5
    v = dict(BASE, batch=b, dim=d, seqlen=T, dstate=dstate, groups=2 if form == "var3" else 1,
             form="fixed" if form == "fixed" else "var4")
    x = _inputs(dtype, v)
    out_scan, last_scan = kspec.ops.selective_scan_fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                                      x["delta_bias"], True, return_last_state=True, h0=x["h0"])
    state = x["h0"].clone()
    for t in range(T):
        if form == "fixed":
            Bt, Ct = x["B"], x["C"]
        elif form == "var2":
            Bt, Ct = x["B"][:, 0, :, t], x["C"][:, 0, :, t]
        else:
            Bt, Ct = x["B"][..., t], x["C"][..., t]
        if form == "fixed":
            o = torch.empty(b, d, device="cuda", dtype=dtype)
            kspec.call("selective_scan.step", state, x["u"][:, :, t].contiguous(), x["delta"][:, :, t].contiguous(),
                       x["A"], Bt, Ct, x["D"], x["z"][:, :, t].contiguous(), x["delta_bias"], delta_softplus=True,
                       out=(o, state))
        else:
            o = kspec.ops.selective_scan_step(state, x["u"][:, :, t], x["delta"][:, :, t], x["A"], Bt, Ct, x["D"],
                                              x["z"][:, :, t], x["delta_bias"], delta_softplus=True)
        tol = 2 * TOL[str(dtype).split(".")[1]]
        assert rel_err(_np(o), _np(out_scan[:, :, t])) <= tol, t
    assert rel_err(_np(state), _np(last_scan)) <= 1e-5


def test_torch_compile_through_custom_op():
    x = _inputs(torch.bfloat16, dict(BASE, seqlen=64))
    leaves = {k: t.clone().requires_grad_() for k, t in x.items() if t is not None}

    def f(u, delta, A, B, C, D, z, delta_bias):
        return kspec.ops.selective_scan_fn(u * 1, delta, A, B, C, D, z, delta_bias, True).float().square().sum()

    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    out = torch.compile(f, fullgraph=True)(*(leaves[k] for k in names))
    out.backward()
    compiled = {k: leaves[k].grad.clone() for k in names}
    for k in names:
        leaves[k].grad = None
    f(*(leaves[k] for k in names)).backward()
    for k in names:
        assert rel_err(_np(compiled[k]), _np(leaves[k].grad)) < 1e-2, k


def test_bad_inputs_on_gpu():
    x = _inputs(torch.float32, dict(BASE))
    with pytest.raises(ValueError, match="input 'delta'.*dtype"):
        kspec.ops.selective_scan_fn(x["u"], x["delta"].half(), x["A"], x["B"], x["C"])
    with pytest.raises(ValueError, match="groups = 5 must divide dim = 24"):
        B = torch.randn(2, 5, 16, 300, device="cuda")
        kspec.ops.selective_scan_fn(x["u"], x["delta"], x["A"], B, B)
    with pytest.raises(NotImplementedError, match="input 'A': dstate = 300"):
        A = -torch.rand(24, 300, device="cuda")
        kspec.ops.selective_scan_fn(x["u"], x["delta"], A, A, A)


def test_cpp_checker_from_python():
    for op in ("selective_scan.fwd", "selective_scan.bwd", "selective_scan.step"):
        rows = kspec.check(op, case="groups_4")
        assert rows and all(r["passed"] for r in rows), rows
