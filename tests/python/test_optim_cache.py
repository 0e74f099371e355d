"""kspec.optim.AdamW's launch cache, without a GPU: host tensors, kspec's native BoundCall replaced by a
recorder. A step binds once and then only runs; any change to what the bound call was built from (the
parameter list, a re-allocated parameter, a gradient or state tensor at a new address, a state dict
loaded, an edited step count, grad_scale, amsgrad) binds again with the new pointers. On a GPU: the real
BoundCall against torch's fused AdamW across such changes."""
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
import kspec.optim  # noqa: E402


def make(n=5, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(3 + i, 2, generator=g)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps, kspec.optim.AdamW(ps, lr=1e-2, **kw)


def ptrs(bound, slot):
    return [d[0] for d in bound.inputs[slot]]


def test_steps_bind_once_then_only_run(recorder):
    ps, opt = make()
    for _ in range(3):
        opt.step()
    assert len(recorder.binds) == 1
    b = recorder.binds[0]
    assert [r["step"] for r in b.runs] == [1, 2, 3]
    assert all(float(opt.state[p]["step"]) == 3.0 for p in ps)
    assert ptrs(b, 0) == [p.data_ptr() for p in ps] and ptrs(b, 1) == [p.grad.data_ptr() for p in ps]
    assert b.params["maximize"] is False and b.inputs[4] is None and b.inputs[5] is None
    opt.param_groups[0]["lr"] = 5e-3  # a runtime param: no new bind
    opt.step()
    assert len(recorder.binds) == 1 and b.runs[-1]["lr"] == 5e-3


@pytest.mark.parametrize("change", ["param_list", "param_realloc", "grad_realloc", "grad_none", "state_tensor",
                                    "load_state_dict", "step_edited", "amsgrad", "maximize", "grad_scale"])
def test_any_change_binds_again_with_the_new_pointers(recorder, change):
    ps, opt = make()
    opt.step()
    opt.step()
    assert len(recorder.binds) == 1
    scale = None
    if change == "param_list":
        extra = torch.nn.Parameter(torch.randn(4))
        extra.grad = torch.randn(4)
        opt.param_groups[0]["params"].append(extra)
        ps = ps + [extra]
    elif change == "param_realloc":
        ps[2].data = ps[2].data.clone()  # same Parameter object, new memory
    elif change == "grad_realloc":
        ps[1].grad = ps[1].grad.clone()
    elif change == "grad_none":
        ps[3].grad = None
    elif change == "state_tensor":
        opt.state[ps[0]]["exp_avg"] = opt.state[ps[0]]["exp_avg"].clone()
    elif change == "load_state_dict":
        opt.load_state_dict(opt.state_dict())
    elif change == "step_edited":
        opt.state[ps[0]]["step"].fill_(7.0)
    elif change == "amsgrad":
        opt.param_groups[0]["amsgrad"] = True
    elif change == "maximize":
        opt.param_groups[0]["maximize"] = True
    elif change == "grad_scale":
        scale = torch.tensor([1.0])
    opt.step(grad_scale=scale)
    assert len(recorder.binds) >= 2, change
    new = recorder.binds[-1]
    live = [p for p in ps if p.grad is not None]
    # a new parameter or an edited step count has its own launch: the binds since the change, in order
    since = recorder.binds[1:]

    def all_ptrs(slot):
        return [x for b in since for x in ptrs(b, slot)]

    assert all_ptrs(0) == [p.data_ptr() for p in live]
    assert all_ptrs(1) == [p.grad.data_ptr() for p in live]
    assert all_ptrs(2) == [opt.state[p]["exp_avg"].data_ptr() for p in live]
    if change == "amsgrad":
        assert all_ptrs(5) == [opt.state[p]["max_exp_avg_sq"].data_ptr() for p in live]
    if change == "maximize":
        assert new.params["maximize"] is True
    if change == "grad_scale":
        assert new.inputs[6][0] == scale.data_ptr() and new.outputs[0] is not None
    if change == "step_edited":  # p0 now has its own step count: two launches
        assert sorted(r["step"] for b in recorder.binds[1:] for r in b.runs) == [3, 8]
    count = len(recorder.binds)
    opt.step(grad_scale=scale)  # and the new ones are kept
    assert len(recorder.binds) == count and new.runs


def test_a_non_contiguous_gradient_is_never_bound(recorder, monkeypatch):
    calls = []
    monkeypatch.setattr(kspec.optim, "call", lambda op, *a, **k: calls.append(a))
    ps, opt = make()
    ps[1].grad = torch.randn(2, ps[1].shape[0]).t()  # a copy is made every step: no pointer to keep
    opt.step()
    opt.step()
    assert recorder.binds == [] and len(calls) == 2


def test_sparse_gradients_are_refused_also_after_cached_steps(recorder):
    ps, opt = make(n=2)
    opt.step()
    ps[0].grad = torch.randn(ps[0].shape).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse"):
        opt.step()


def test_state_dict_steps_do_not_alias_the_live_counters(recorder):
    ps, opt = make()
    opt.step()
    sd = opt.state_dict()
    opt.step()
    assert float(sd["state"][0]["step"]) == 1.0 and float(opt.state[ps[0]]["step"]) == 2.0
    twin = kspec.optim.AdamW(ps, lr=1e-2)
    twin.load_state_dict(sd)
    assert float(twin.state[ps[0]]["step"]) == 1.0


@pytest.mark.gpu
def test_gpu_cached_launches_match_torch_fused_across_reallocations():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (5, 4097, 70000)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ours, theirs = kspec.optim.AdamW(ps, **kw), torch.optim.AdamW(twins, fused=True, **kw)
    for i in range(6):
        for p, t in zip(ps, twins):
            g = torch.randn(p.shape, device="cuda")
            p.grad, t.grad = (g.clone(), g.clone()) if i % 2 else (g, g.clone())  # new and kept addresses
        if i == 3:
            ps[1].data = ps[1].data.clone()  # a parameter moved to new memory
        ours.step()
        theirs.step()
    for p, t in zip(ps, twins):
        assert torch.allclose(p, t, rtol=1e-5, atol=1e-6)
