"""The lean tile kernels (selective_scan.fwd algo=tile, items=8: y's sum over a lane's states in one FMA chain a
step; items=16: and the fold's maps read ahead; templates/selective_scan/tile.cuh, kLean 1 and 2) without a GPU:
which configs take them, their kernels' names, and that NVRTC compiles them for both CI architectures without a
spill, within the 255 registers that 2 blocks of 4 warps an SM allow. On the GPU, against the float64 reference:
test_gpu_selective_scan.py's test_tile_kernel_forward_states_and_backward[w4_lean-*]."""
import pytest

import kspec

_ISSUE_SHAPE = dict(batch=1, dim=2048, seqlen=512, dstate=16, delta_softplus=True)


def _config(warps=4, items=8, lanes=1):
    return f"algo=tile,warps={warps},items={items},lanes={lanes},chunk=32,segs=1"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", ["bf16", "bf16_no_h0", "f16_fixed_b_no_z_no_h0"])
@pytest.mark.parametrize("items,lean", [(8, 1), (16, 2)])
def test_lean_tile_kernel_compiles_without_spills(arch, variant, items, lean):
    dtype = variant.split("_")[0]
    kw = dict(without=["z", "h0"], alt_shapes=["B"]) if "fixed_b" in variant else \
        dict(without=["h0"]) if "no_h0" in variant else {}
    reports = kspec.compile("selective_scan.fwd", dtype=dtype, arch=arch, config=_config(items=items), **_ISSUE_SHAPE,
                            **kw)
    assert len(reports) == 1 and f", 4, 4, {lean}>>" in reports[0]["kernel"], reports
    for r in reports:
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, (r["arch"], r["registers"], r["log"][-1500:])


def test_lean_tile_kernel_is_a_config_of_4_warps_of_4_states_a_lane():
    for cfg in (_config(warps=6), _config(warps=8, items=16), _config(lanes=8), _config(warps=2, lanes=8, items=16)):
        with pytest.raises(ValueError, match=r"lean kernels \(items=8, 16\) run 4 warps of 4 states a lane"):
            kspec.compile("selective_scan.fwd", dtype="bf16", arch="sm_90", config=cfg, **_ISSUE_SHAPE)
    # the measured kernel keeps its name (and so its cached binaries); the heuristic keeps items=4
    before = kspec.compile("selective_scan.fwd", dtype="bf16", arch="sm_90", config=_config(items=4), **_ISSUE_SHAPE)
    assert before[0]["kernel"].split("|")[0].endswith(">, 4>>"), before
    default = kspec.compile("selective_scan.fwd", dtype="bf16", arch="sm_90", **_ISSUE_SHAPE)
    assert [r["kernel"] for r in default] == [before[0]["kernel"]], default
