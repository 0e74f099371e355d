"""Every op under CUDA-graph capture with torch's documented recipe (issue 33): warm up on a side stream,
capture with `torch.cuda.graph(g)` (which captures on a stream of its own that no warm-up ran on, so
kspec's workspace there is an allocation of the graph), give the inputs new values, replay, and compare
with the eager call on those values. Forward and backward (autograd inside the capture)."""
import pytest

from helpers import rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402

pytestmark = pytest.mark.gpu


def _captured_matches_eager(fn, inputs, tol=1e-6):
    """fn() -> tuple of tensors, reading `inputs` (refreshed in place before the replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fn()
    for t in inputs:
        with torch.no_grad():
            t.copy_(torch.randn_like(t) if t.is_floating_point() else t)
    g.replay()
    torch.cuda.synchronize()
    eager = fn()
    for c, e in zip(captured, eager):
        assert c.shape == e.shape
        assert rel_err(c.detach().double().cpu().numpy(), e.detach().double().cpu().numpy()) <= tol


def _grads(out, leaves):
    """(out, *d out·w / d leaves) for a fixed weighting w, autograd inside the capture."""
    w = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    return (out, *torch.autograd.grad((out * w).sum(), leaves))


def r(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_linear_forward_and_backward(act, dtype):
    # the shape (needs cuBLASLt's 32 MiB workspace) and an LLM-like one
    for m, n, k in ((33, 4097, 7), (256, 1024, 512)):
        x, w, b = r(m, k, dtype=dtype), r(n, k, dtype=dtype), r(n, dtype=dtype)
        _captured_matches_eager(lambda: _grads(kspec.ops.linear(x, w, b, act), (x, w, b)), (x, w, b))


def test_raw_gemm_and_gemm_bwd():
    x, w, b = r(64, 96, grad=False), r(128, 96, grad=False), r(128, grad=False)

    def fn():
        y, pre = kspec.ops.gemm(x, w, b, act="gelu", save_pre=True)
        return (y, *kspec.ops.gemm_bwd(y, x, w, pre, act="gelu"))

    _captured_matches_eager(fn, (x, w, b))


def test_norm_act_forward_and_backward():
    x, w, b = r(64, 1024), r(1024), r(1024)
    _captured_matches_eager(
        lambda: _grads(kspec.ops.norm_act(x, w, b, norm="layernorm", act="silu"), (x, w, b)), (x, w, b), tol=1e-5)


def test_selective_scan_forward_and_backward():
    B, D, L, N = 2, 64, 128, 16
    u, delta, z = r(B, D, L), r(B, D, L), r(B, D, L)
    A = (-torch.rand(D, N, device="cuda") - 0.5).requires_grad_()
    Bm, Cm, Dv, db = r(B, N, L), r(B, N, L), r(D), r(D)

    def fn():
        out = kspec.ops.selective_scan_fn(u, delta, A, Bm, Cm, Dv, z, db, delta_softplus=True)
        return _grads(out, (u, delta, A, Bm, Cm, Dv, z, db))

    _captured_matches_eager(fn, (u, delta, Bm, Cm, z), tol=1e-5)


def test_e79_forward_and_backward():
    n, T, Bt = 16, 9, 2
    kvqm = (0.5 * torch.randn(T, Bt, 4 * n, device="cuda")).requires_grad_()
    b_s, b_m = r(n), r(n)

    def fn():
        out, S, M = kspec.ops.e79_cell(kvqm, n, b_s, b_m, bias="fixed")
        return (S, M, *_grads(out, (kvqm, b_s, b_m)))

    _captured_matches_eager(fn, (kvqm,), tol=1e-5)


def test_adamw_step():
    """One captured kspec.optim.AdamW step, replayed, against torch.optim.AdamW's eager step from the same
    state (the step count is baked into the graph, as for any captured optimizer step)."""
    p = torch.randn(4097, device="cuda", requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = kspec.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    q = p.detach().clone().requires_grad_()
    q.grad = p.grad.clone()
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    state = opt.state_dict()
    ref.load_state_dict({"state": {0: {k: v.clone() for k, v in state["state"][0].items()}},
                         "param_groups": state["param_groups"]})
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        opt.step()
    g.replay()
    ref.step()
    torch.cuda.synchronize()
    assert rel_err(p.detach().double().cpu().numpy(), q.detach().double().cpu().numpy()) <= 1e-5


def test_linear_under_torch_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead") records CUDA graphs of the custom ops (kspec::linear_fwd and
    its backward) on streams of its own; the replays match eager."""
    torch._dynamo.reset()
    x, w, b = r(33, 7, dtype=torch.bfloat16), r(4097, 7, dtype=torch.bfloat16), r(4097, dtype=torch.bfloat16)

    def f(x, w, b):
        return kspec.ops.linear(x, w, b, "relu").float().square().sum()

    compiled = torch.compile(f, mode="reduce-overhead")
    for _ in range(4):  # warm-up runs, then recorded, then replayed
        x.data.copy_(torch.randn_like(x))
        loss = compiled(x, w, b)
        got = (loss.detach().clone(), *torch.autograd.grad(loss, (x, w, b)))
        want_loss = f(x, w, b)
        want = (want_loss.detach(), *torch.autograd.grad(want_loss, (x, w, b)))
        for g, e in zip(got, want):
            assert rel_err(g.double().cpu().numpy(), e.double().cpu().numpy()) <= 1e-5
