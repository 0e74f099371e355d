"""The mhc bench's 'kspec pre.bwd mma_slice_du1_nb / mma_slice_du1_mb …' rows without a GPU: mhc.pre.bwd's algo=10
and 11 at mma_slice_du1's tile, none where mma_slice has no tile; each config compiles (NVRTC, no GPU) to the token
pass, the slice kernel with kDuHiOnly and kGroupSync 1 (named barrier) or 2 (mbarrier) as its last template
arguments, and the reduce of db and dalpha alone."""
from test_bench_script import bench, families  # noqa: F401  (the fixtures: tools/bench's families, discovered)


def test_mhc_bench_pre_bwd_sync_configs_compile_their_kernels(families):  # noqa: F811
    import kspec

    mhc = families["mhc"]
    k = mhc.PRE_BWD_KERNELS
    assert mhc.pre_bwd_sync_configs(4, 4096) == {k + "mma_slice_du1_nb 32": "algo=10,threads=128,tokens=32",
                                                 k + "mma_slice_du1_mb 32": "algo=11,threads=128,tokens=32"}
    assert list(mhc.pre_bwd_sync_configs(2, 4096)) == [k + "mma_slice_du1_nb 64", k + "mma_slice_du1_mb 64"]
    assert mhc.pre_bwd_sync_configs(4, 100) == {} and mhc.pre_bwd_sync_configs(5, 128) == {}
    for config in mhc.pre_bwd_sync_configs(4, 128).values():
        kernels = [r["kernel"] for r in kspec.compile("mhc.pre.bwd", dtype="bf16", arch="sm_90", config=config,
                                                      n=4, D=128, t_max=20)]
        assert len(kernels) == 3, kernels
        assert kernels[0].startswith("kspec::mhc_pre_bwd_token_mma_kernel<"), kernels
        sync = "1" if config.startswith("algo=10") else "2"
        assert kernels[1].startswith("kspec::mhc_pre_bwd_slice_mma_kernel<") and kernels[1].endswith(
            f", 4, true, {sync}>"), kernels
        assert kernels[2].startswith("kspec::mhc_pre_bwd_reduce_kernel<") and kernels[2].endswith("true>"), kernels
