"""The mhc bench's 'kspec pre.bwd mma_slice …' rows without a GPU: mhc.pre.bwd's algo=mma_slice (8) at
mma_fused_warp_heads' tile and at 16 tokens, algo=mma_slice_du1 (9) at that tile, none where that algo has no tile;
each config compiles (NVRTC, no GPU) to the token kernel with heads per warp, the slice kernel (kDuHiOnly its
second-to-last template argument) and the reduce of db and dalpha alone."""
from test_bench_script import bench, families  # noqa: F401  (the fixtures: tools/bench's families, discovered)


def test_mhc_bench_pre_bwd_slice_configs_compile_the_slice_kernel(families):  # noqa: F811
    import kspec

    mhc = families["mhc"]
    assert mhc.pre_bwd_slice_configs(4, 4096) == {
        **{mhc.PRE_BWD_KERNELS + f"mma_slice {t}": f"algo=8,threads=128,tokens={t}" for t in (32, 16)},
        mhc.PRE_BWD_KERNELS + "mma_slice_du1 32": "algo=9,threads=128,tokens=32"}
    assert list(mhc.pre_bwd_slice_configs(2, 4096)) == [mhc.PRE_BWD_KERNELS + v for v in ("mma_slice 64",
                                                                                          "mma_slice 16",
                                                                                          "mma_slice_du1 64")]
    assert mhc.pre_bwd_slice_configs(4, 100) == {} and mhc.pre_bwd_slice_configs(5, 128) == {}
    for config in mhc.pre_bwd_slice_configs(4, 128).values():
        kernels = [r["kernel"] for r in kspec.compile("mhc.pre.bwd", dtype="bf16", arch="sm_90", config=config,
                                                      n=4, D=128, t_max=20)]
        assert kernels[0].startswith("kspec::mhc_pre_bwd_token_mma_kernel<") and kernels[0].endswith(
            "false, false, true>"), kernels
        du1 = "true, 0>" if config.startswith("algo=9") else "false, 0>"  # kDuHiOnly, kGroupSync 0 (block barrier)
        assert kernels[1].startswith("kspec::mhc_pre_bwd_slice_mma_kernel<") and kernels[1].endswith(", 4, " + du1), kernels
        assert kernels[2].startswith("kspec::mhc_pre_bwd_reduce_kernel<") and kernels[2].endswith("true>"), kernels
