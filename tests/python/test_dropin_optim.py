"""kspec.optim.AdamW as a drop-in for torch.optim.AdamW: every argument of torch's signature is taken
(honoured, recorded, or refused with a clear error), and state dicts move both ways. Without a GPU the
kernel is replaced by a recorder (conftest.py's, as in test_optim_cache.py) to check what a step would launch and the
state dicts' structure; on a GPU the numerics against torch across a state-dict hand-over either way."""
import copy
import inspect
import warnings

import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
import kspec.optim  # noqa: E402


def params(n=3, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(4 + i, 3, generator=g).to(device, dtype)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device, dtype)
    return ps


def test_takes_every_torch_adamw_argument():
    ours = inspect.signature(kspec.optim.AdamW).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    missing = [n for n in theirs if n not in ours]
    assert not missing, f"kspec.optim.AdamW lacks torch.optim.AdamW's {missing}"
    for name, p in theirs.items():  # same kind (positional or keyword-only) and default
        assert ours[name].kind == p.kind and ours[name].default == p.default, name
    opt = kspec.optim.AdamW(params(), lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=True,
                            maximize=True, foreach=False, fused=True)
    ref = torch.optim.AdamW(params(), lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=True,
                            maximize=True, foreach=False)
    assert set(opt.defaults) == set(ref.defaults)  # the param groups carry torch's keys
    assert opt.defaults["decoupled_weight_decay"] is True and opt.defaults["fused"] is True


def test_honours_maximize_amsgrad_and_tensor_hyperparameters(recorder):
    ps = params()
    opt = kspec.optim.AdamW(ps, lr=torch.tensor(0.02), betas=(torch.tensor(0.8), torch.tensor(0.9)),
                            amsgrad=True, maximize=True, fused=True, foreach=None)
    opt.step()
    b = recorder.binds[0]
    assert b.params["maximize"] is True and b.inputs[5] is not None  # max_exp_avg_sq: AMSGrad
    run = b.runs[-1]
    assert run["lr"] == pytest.approx(0.02)
    assert run["beta1"] == pytest.approx(0.8) and run["beta2"] == pytest.approx(0.9)
    opt.param_groups[0]["lr"].fill_(0.01)  # a tensor lr is read at each step
    opt.step()
    assert b.runs[-1]["lr"] == pytest.approx(0.01) and b.runs[-1]["step"] == 2


@pytest.mark.parametrize("bad, match", [
    (dict(differentiable=True), "differentiable=True is not supported"),
])
def test_refuses_what_it_cannot_honour(bad, match):
    with pytest.raises(NotImplementedError, match=match):
        kspec.optim.AdamW(params(), **bad)


@pytest.mark.parametrize("bad, match", [
    (dict(lr=torch.tensor([1e-3, 2e-3])), "Tensor lr must be 1-element"),
    (dict(lr=-1.0), "invalid hyperparameters"),
    (dict(betas=(0.9, 1.0)), "invalid hyperparameters"),
    (dict(capturable=True, lr=torch.tensor(1e-3, dtype=torch.float64)), "reads a Tensor lr on the device as float32"),
])
def test_bad_hyperparameters_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        kspec.optim.AdamW(params(), **bad)


def test_a_loaded_differentiable_group_is_refused_at_step(recorder):
    ps = params()
    opt = kspec.optim.AdamW(ps)
    sd = torch.optim.AdamW(ps).state_dict()
    sd["param_groups"][0]["differentiable"] = True
    opt.load_state_dict(sd)
    with pytest.raises(NotImplementedError, match="differentiable"):
        opt.step()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_to_torch_and_back(recorder, amsgrad):
    """kspec -> torch: torch loads kspec's state (names, step tensors, moments) and steps on from it;
    torch -> kspec: kspec's next step launches with torch's moments and step count + 1."""
    ps = params()
    opt = kspec.optim.AdamW(ps, lr=1e-2, amsgrad=amsgrad)
    for _ in range(3):
        opt.step()
    sd = opt.state_dict()
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    assert all(set(s) == keys for s in sd["state"].values())
    assert all(float(s["step"]) == 3.0 and s["step"].dim() == 0 for s in sd["state"].values())

    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    ref = torch.optim.AdamW(qs, lr=1e-2, amsgrad=amsgrad)
    ref.load_state_dict(sd)
    assert ref.param_groups[0]["decoupled_weight_decay"] is True
    for i, q in enumerate(qs):
        for k in keys - {"step"}:
            assert torch.equal(ref.state[q][k], sd["state"][i][k])
    ref.step()  # torch steps on from kspec's state
    assert all(float(ref.state[q]["step"]) == 4.0 for q in qs)

    back = kspec.optim.AdamW(ps, lr=1e-2, amsgrad=amsgrad)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    back.step()
    b = recorder.binds[-1]
    assert b.runs[-1]["step"] == 5
    moments = [back.state[p]["exp_avg"] for p in ps]
    assert [d[0] for d in b.inputs[2]] == [m.data_ptr() for m in moments]
    assert all(torch.equal(m, ref.state[q]["exp_avg"]) for m, q in zip(moments, qs))


def test_bf16_state_from_torch_is_widened(recorder):
    """torch keeps a bf16 parameter's moments in bf16; kspec's kernel takes fp32 moments and an fp32
    master copy, made on load."""
    qs = params(dtype=torch.bfloat16)
    ref = torch.optim.AdamW(qs)
    ref.step()
    ps = [torch.nn.Parameter(q.detach().clone()) for q in qs]
    for p, q in zip(ps, qs):
        p.grad = q.grad.clone()
    opt = kspec.optim.AdamW(ps)
    opt.load_state_dict(ref.state_dict())
    opt.step()
    for p, q in zip(ps, qs):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], ref.state[q]["exp_avg"].float())
        assert st["master"].dtype == torch.float32 and torch.equal(st["master"], p.detach().float())
    assert recorder.binds[-1].runs[-1]["step"] == 2


# ---- on a GPU: the numerics ----

def _assert_close(ps, qs, tol):
    for p, q in zip(ps, qs):
        err = ((p.detach().double() - q.detach().double()).norm() / q.detach().double().norm()).item()
        assert err <= tol, err


def _grads(ps, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", generator=g).to(p.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(), dict(amsgrad=True), dict(maximize=True), dict(lr=torch.tensor(3e-3)),
                                dict(fused=True, foreach=False)], ids=["plain", "amsgrad", "maximize", "tensor_lr",
                                                                        "fused_flag"])
def test_gpu_state_dict_round_trip_numerics(kw):
    """3 kspec steps, then torch steps on from kspec's state dict while kspec keeps going; then kspec
    steps on from torch's state dict: the parameters agree to fp32 rounding throughout."""
    torch_kw = {k: v for k, v in kw.items() if k != "fused"}
    ps = params(device="cuda")
    opt = kspec.optim.AdamW(ps, weight_decay=0.1, **kw)
    for s in range(3):
        _grads(ps, s)
        opt.step()
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.AdamW(qs, weight_decay=0.1, **torch_kw)
    # a checkpoint's copy: load_state_dict keeps a tensor of the right dtype and device as it is (torch's
    # and kspec's), so a live state dict would leave both optimizers stepping one set of moments
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(3, 6):
        _grads(ps, s)
        _grads(qs, s)
        opt.step()
        ref.step()
    _assert_close(ps, qs, 1e-5)
    rs = [torch.nn.Parameter(q.detach().clone()) for q in qs]
    back = kspec.optim.AdamW(rs, weight_decay=0.1, **kw)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    for s in range(6, 9):
        _grads(rs, s)
        _grads(qs, s)
        back.step()
        ref.step()
    _assert_close(rs, qs, 1e-5)


def test_bf16_kspec_state_reloads_without_rounding(recorder):
    """torch's load_state_dict casts state to the parameter's dtype; kspec's fp32 moments and master
    copy of a bf16 parameter come back exactly."""
    ps = params(dtype=torch.bfloat16)
    opt = kspec.optim.AdamW(ps)
    opt.step()
    for p in ps:  # values a bf16 rounding would change
        for k in ("exp_avg", "exp_avg_sq", "master"):
            opt.state[p][k].add_(1e-4 * torch.arange(p.numel()).view(p.shape))
    sd = opt.state_dict()
    again = kspec.optim.AdamW(ps)
    again.load_state_dict(sd)
    for i, p in enumerate(ps):
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert again.state[p][k].dtype == torch.float32 and torch.equal(again.state[p][k], sd["state"][i][k]), k


def _no_host_reads(monkeypatch):
    """Make every read of a tensor's value on the host fail (what a captured step may not do)."""
    def refuse(self, *a):
        raise AssertionError("a tensor was read back to the host")
    for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_capturable_steps_count_on_the_device_and_read_nothing_back(recorder, monkeypatch):
    """capturable=True: after the first step (which builds the launch, as torch's warm-up does), a step
    reads no tensor back to the host; the kernel gets the step count as a tensor (device_step, the
    parameters' one step buffer) and the host's `step` param is unused; a step skipped for an inf
    gradient is taken back on the device."""
    import ctypes

    ps = params()
    opt = kspec.optim.AdamW(ps, lr=0.01, capturable=True)
    assert opt.param_groups[0]["capturable"] is True
    scale = torch.ones(1)
    opt.step(grad_scale=scale)
    skip = []

    def run(self, hyper, outputs, stream):  # the kernel's found_inf: 1 when asked
        self.runs.append(dict(hyper))
        if skip:
            ctypes.c_float.from_address(outputs[0][0]).value = 1.0

    monkeypatch.setattr(recorder, "run", run)
    _no_host_reads(monkeypatch)
    opt.step(grad_scale=scale)
    skip.append(True)
    opt.step(grad_scale=scale)
    monkeypatch.undo()
    assert len(recorder.binds) == 1 and len(recorder.binds[0].runs) == 3
    steps = [opt.state[p]["step"] for p in ps]
    assert all(s.device == ps[0].device and float(s) == 2 for s in steps)  # the skipped third is taken back
    assert float(opt.found_inf) == 1
    b = recorder.binds[-1]
    step_in = b.inputs[7]
    assert step_in is not None and step_in[0] == steps[0].data_ptr() and step_in[2] == (1,)
    assert b.inputs[8] is None  # a float lr is a launch argument
    assert all(r["step"] == 1 and r["lr"] == pytest.approx(0.01) for r in b.runs)


def test_capturable_state_dicts_go_both_ways_with_torch(recorder):
    """A kspec capturable state dict loads into torch's AdamW(capturable=True) and back, keeping the
    flag (no warning) and the step count, which the next step continues on the device."""
    ps = params()
    opt = kspec.optim.AdamW(ps, weight_decay=0.1, capturable=True)
    for _ in range(2):
        opt.step()
    ref = torch.optim.AdamW(params(), weight_decay=0.1, capturable=True)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    sd = ref.state_dict()
    assert sd["param_groups"][0]["capturable"] is True and float(sd["state"][0]["step"]) == 2
    again = kspec.optim.AdamW(ps, capturable=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(copy.deepcopy(sd))
    assert again.param_groups[0]["capturable"] is True
    for i, p in enumerate(ps):
        assert torch.equal(again.state[p]["exp_avg"], sd["state"][i]["exp_avg"])
    again.step()
    assert all(float(again.state[p]["step"]) == 3 for p in ps)
    assert recorder.binds[-1].inputs[7] is not None  # the count the kernel reads, on the device


@pytest.mark.gpu
def test_gpu_capturable_step_in_a_cuda_graph_matches_torch():
    """opt.step() captured in a CUDA graph and replayed 3 times, with new gradients and a new (tensor) lr
    before each replay, against torch's AdamW(capturable=True) captured the same way: parameters, moments
    and step counts within 1e-5 (fp32). A replay whose gradient holds an inf (with grad_scale) changes
    nothing, step count included."""
    lr_k = torch.tensor(1e-2, device="cuda")
    lr_t = lr_k.clone()
    ps = params(device="cuda")
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    opt = kspec.optim.AdamW(ps, lr=lr_k, weight_decay=0.1, amsgrad=True, capturable=True)
    ref = torch.optim.AdamW(qs, lr=lr_t, weight_decay=0.1, amsgrad=True, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch asks: state and launches built outside the graph
        opt.step()
        ref.step()
    torch.cuda.current_stream().wait_stream(side)
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    with torch.cuda.graph(graphs[0]):
        opt.step()
    with torch.cuda.graph(graphs[1]):
        ref.step()
    g = torch.Generator(device="cuda").manual_seed(1)
    for i in range(3):
        for p, q in zip(ps, qs):
            p.grad.copy_(torch.randn(p.shape, generator=g, device="cuda"))
            q.grad.copy_(p.grad)
        lr_k.fill_(1e-2 / (i + 2))
        lr_t.fill_(1e-2 / (i + 2))
        for graph in graphs:
            graph.replay()
    torch.cuda.synchronize()
    _assert_close(ps, qs, 1e-5)
    for p, q in zip(ps, qs):
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][k], ref.state[q][k], rtol=1e-5, atol=1e-6)
        # the warm-up step and the 3 replays (a capture records the step, it does not run it)
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 4

    scale = torch.ones(1, device="cuda")
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        opt.step(grad_scale=scale)
    torch.cuda.current_stream().wait_stream(side)
    scaled = torch.cuda.CUDAGraph()
    with torch.cuda.graph(scaled):
        opt.step(grad_scale=scale)
    before = [p.detach().clone() for p in ps]
    ps[0].grad[0, 0] = float("inf")
    scaled.replay()
    torch.cuda.synchronize()
    assert float(opt.found_inf) == 1
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert all(float(opt.state[p]["step"]) == 5 for p in ps)  # the warm-up's step; the inf replay's none


@pytest.mark.gpu
def test_gpu_steps_on_from_torch_capturable_and_fused_checkpoints():
    """Checkpoints of torch's AdamW(capturable=True) and AdamW(fused=True) (step counts on the GPU):
    kspec steps on from them as torch does."""
    for kw in (dict(capturable=True), dict(fused=True)):
        qs = params(device="cuda")
        ref = torch.optim.AdamW(qs, weight_decay=0.1, **kw)
        for s in range(2):
            _grads(qs, s)
            ref.step()
        ps = [torch.nn.Parameter(q.detach().clone()) for q in qs]
        opt = kspec.optim.AdamW(ps, weight_decay=0.1)
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # a checkpoint's copy (see above)
        for s in range(2, 5):
            _grads(ps, s)
            _grads(qs, s)
            opt.step()
            ref.step()
        _assert_close(ps, qs, 1e-5)
