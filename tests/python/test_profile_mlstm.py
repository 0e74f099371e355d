"""tools/gpu/profile_mlstm.py --compare's step table, without a GPU: the configs it times beside the
default are valid for mlstm.step at its shapes (an invalid one would only fail on the GPU machine), and
the shared timer it imports (tools/bench/timing.py: gpu time with a spin queued before the start event,
apart from the host's enqueue time) is where the script looks for it."""
import importlib.util
import os

import pytest

pytest.importorskip("torch")
import kspec  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "gpu", "profile_mlstm.py")


def _script():
    spec = importlib.util.spec_from_file_location("profile_mlstm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_configs_are_valid_at_the_timed_shapes():
    mod = _script()
    named = [c for c in mod.STEP_CONFIGS if c is not None]
    assert mod.STEP_CONFIGS[0] is None and {c.split(",")[0] for c in named} == {"algo=split", "algo=block"}
    for case in ("B_1_dh_128", "model_B64_NH8_dh128"):  # NH = 8, DH = 128 at B = 1 and 64
        valid = set(kspec._C.configs_for_case("mlstm.step", case, "bf16"))
        for c in named:
            assert c in valid, (case, c)


def test_step_timer_is_found_where_the_script_looks():
    timing = os.path.join(os.path.dirname(os.path.abspath(SCRIPT)), "..", "bench", "timing.py")
    with open(timing) as fh:
        text = fh.read()
    assert "class GpuTimer" in text and "_sleep" in text


def test_compare_backward_algos_are_valid_at_their_head_dims():
    """--compare's backward variants at 128 x 256 and 256 x 512 (the chunkwise cases of those head dims)
    are valid configs there, the first of each shape is algo=tc (the baseline the others are checked
    against), and every timed shape has its list."""
    mod = _script()
    assert set(mod.BWD_ALGOS) == set(mod.COMPARE_DIMS)
    cases = {(128, 256): "dk_128_dv_256", (256, 512): "dk_256_dv_512"}
    for dims, algos in mod.BWD_ALGOS.items():
        assert algos[0] == "tc"
        if dims not in cases:
            continue
        valid = set(kspec._C.configs_for_case("mlstm.chunkwise.bwd", cases[dims], "bf16"))
        for a in algos:
            assert f"algo={a},threads=128" in valid, (dims, a)


def test_compare_forward_algos_are_valid_at_their_head_dims():
    """--compare's forward variants (algo=tc_wide, tc_q128 and both beside tc, the first) are values of
    mlstm.chunkwise.fwd's algo axis, tc_wide and tc_q128 valid at cases of those head dims (the chunk-128
    shapes it times: Mlstm.WideStateTiles, Mlstm.ForwardOutputKernelOn128Rows)."""
    mod = _script()
    assert mod.FWD_ALGOS[0] == "tc" and {"tc_wide", "tc_q128", "tc_wide_q128"} <= set(mod.FWD_ALGOS)
    names = dict(kspec.op_info("mlstm.chunkwise.fwd")["tuning_names"])["algo"]
    assert set(mod.FWD_ALGOS) <= set(names)
    for case, algo in (("dk_128_dv_256", "tc_wide"), ("dk_256_dv_512", "tc_wide"),
                       ("dk_128_dv_256_chunk_256", "tc_q128")):
        assert f"algo={algo},threads=128" in set(kspec._C.configs_for_case("mlstm.chunkwise.fwd", case, "bf16"))


def test_kernel_times_sum_each_kernel_per_call(monkeypatch):
    """--kernels' table from the profiler's events (no GPU: a stand-in profiler): kspec's mlstm kernels by
    name without template arguments, launches and µs per call; other kernels (the L2 flush, torch's) left out."""
    import types

    import torch.profiler

    mod = _script()
    events = [types.SimpleNamespace(key="void kspec::mlstm_tc_out_kernel<__nv_bfloat16, 256, 512, 128>", count=10,
                                    device_time_total=25000.0),
              types.SimpleNamespace(key="void kspec::mlstm_tc_state_kernel<__nv_bfloat16, 256, 512, 128, false>",
                                    count=10, device_time_total=9000.0),
              types.SimpleNamespace(key="void kspec::mlstm_tc_reduce_kernel<__nv_bfloat16, 256, 512, 0>", count=20,
                                    device_time_total=4000.0),
              types.SimpleNamespace(key="void at::native::vectorized_elementwise_kernel<4>", count=10,
                                    device_time_total=500.0)]

    class FakeProfile:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def key_averages(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda: None)
    calls = []
    got = mod.kernel_times(lambda: calls.append(1), 10)
    assert len(calls) == 11  # one warm-up call, then the profiled ones
    assert got == {"mlstm_tc_out_kernel": (1.0, 2500.0), "mlstm_tc_state_kernel": (1.0, 900.0),
                   "mlstm_tc_reduce_kernel": (2.0, 400.0)}
