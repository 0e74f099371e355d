"""The mlstm benchmark's peers (mlstm_kernels' Triton kernels, the parallel form in torch) and their warm-up.

Imported by the mlstm family (tools/bench/mlstm.py); run as a script it is one warm-up worker:

    python3 tools/bench/mlstm_peers.py '[{"kind": "xl_chunk", "S": 4096, "DK": 128, "DV": 128, "L": 64}, ...]'

Why workers: mlstm_kernels' Triton kernels take B, NH, S, the strides and the chunk as constexprs, so every
(S, head dims, chunk) of issue 29's table compiles its own ~6 kernels, over a hundred in all, one after the
other in the timing process (the reason the full table took > 150 s on the H100). Workers compile them side
by side at the real shapes into Triton's on-disk cache, which the timing process then hits (the bench
compiles kspec's kernels and torch.compile's one dynamic-shape graph meanwhile; a "compile" task here does
the latter into inductor's cache, for use on its own). A worker's failure (an OOM with other workers on the
GPU, say) only costs the timing process that compile: it never changes a figure.
"""
from __future__ import annotations

import json
import os
import sys


def _llvm_workaround():
    """triton 3.6's LLVM crashes compiling xl_chunk without it (costs 1-3%); part of Triton's cache key, so
    the workers and the timing process set it alike. Set only once mlstm's peers load: other families'
    Triton peers in the same run keep LLVM's optimizations."""
    os.environ.setdefault("DISABLE_LLVM_OPT", "1")


B, NH = 8, 8
PEER_CHUNKS = (64, 128, 256)  # xl_chunk's chunk sizes (issue 29: its best L of 64-256)
LIMIT_CHUNK = 64              # limit_chunk's own default
STEP_BATCHES = (1, 8, 64)
STEP_DH = 128
# torch.compile's warm-up shape: every size distinct and > 1, so dynamo's first graph keeps each a symbol of
# its own (duck sizing would tie DHQK to DHHV where they are equal, and a size of 1 is specialized) and every
# shape of the table reuses it without a recompile (checked on the CPU: tests/python/test_bench_script.py).
GENERIC = dict(B=2, NH=3, S=80, DK=16, DV=48)


def torch_parallel(torch, q, k, v, i, f, eps=1e-6):
    """The parallel form in torch (issue 29's formula): F = cumsum(logsigmoid(f)), logD_ts = F_t - F_s + i_s
    (s <= t), m_t = max_s logD_ts, C = s q k^T e^(logD - m), h = C v / (max(|sum_s C_ts|, e^-m) + eps).
    n and m are constants of the backward (detached), as in the kernels of kspec and mlstm_kernels, so its
    gradients are theirs. Memory: B NH S^2 fp32 a few times over (OOM at large S is part of the result)."""
    S, DK = q.shape[-2], q.shape[-1]
    F = torch.cumsum(torch.nn.functional.logsigmoid(f.float()), dim=-1)
    logD = F[..., :, None] - F[..., None, :] + i.float()[..., None, :]
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    logD = logD.masked_fill(~mask, float("-inf"))
    m = logD.amax(dim=-1, keepdim=True).detach()
    C = (q.float() @ k.float().transpose(-1, -2)) * DK ** -0.5 * torch.exp(logD - m)
    n = torch.maximum(C.sum(dim=-1, keepdim=True).abs(), torch.exp(-m)).detach()
    return ((C @ v.float()) / (n + eps)).to(q.dtype)


def compiled_parallel(torch, backend="inductor"):
    """torch.compile of torch_parallel with dynamic shapes: one graph for every row of the table (a static
    graph per shape and grad mode would be 12 compiles, minutes), compiled at GENERIC first by warm_compiled."""
    return torch.compile(lambda q, k, v, i, f: torch_parallel(torch, q, k, v, i, f), dynamic=True, backend=backend)


def warm_compiled(torch, fn, dev, shape=None, dtype=None):
    """Runs fn at `shape` (GENERIC) without and with grad: the graphs every later shape reuses."""
    g = shape or GENERIC
    dt = dtype or torch.bfloat16
    x = [torch.randn(g["B"], g["NH"], g["S"], d, device=dev).to(dt) for d in (g["DK"], g["DK"], g["DV"])]
    x += [torch.randn(g["B"], g["NH"], g["S"], device=dev).to(dt) for _ in range(2)]
    with torch.no_grad():
        fn(*x)
    leaves = [t.clone().requires_grad_() for t in x]
    fn(*leaves).float().sum().backward()
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def chunk_peers():
    """({name: fn(q=, k=, v=, i=, f=, chunk_size=)} of mlstm_kernels' chunkwise Triton kernels, None), or
    ({}, the reason)."""
    _llvm_workaround()
    try:
        from mlstm_kernels.torch.chunkwise import mlstm_chunkwise__limit_chunk, mlstm_chunkwise__xl_chunk
    except Exception as e:  # noqa: BLE001  (absent: the table says so)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return {}, f"mlstm_kernels not importable ({type(e).__name__}: {lines[-1][:160] if lines else ''})"
    return {"xl_chunk": mlstm_chunkwise__xl_chunk, "limit_chunk": mlstm_chunkwise__limit_chunk}, None


def step_peer():
    """mlstm_kernels' Triton step as fn(q, k, v, i, f, C, n, m) -> (h, (C', n', m')), or None."""
    _llvm_workaround()
    try:
        from mlstm_kernels.torch.recurrent.triton_step import mlstm_recurrent_step__triton_fw
    except Exception:  # noqa: BLE001  (absent: the rows say so)
        return None

    def step(q, k, v, i, f, c, n, m):
        return mlstm_recurrent_step__triton_fw(matC_old=c, vecN_old=n, scaM_old=m, vecQ=q, vecK=k, vecV=v, scaI=i,
                                               scaF=f, eps=1e-6)

    return step


def warm_tasks(seqlens, dims, chunks=PEER_CHUNKS, limit=True, compile_torch=True, step=True) -> list:
    """Every compile the timing process would otherwise do itself: xl_chunk at each of `chunks` and
    limit_chunk per (S, head dims), the Triton step per batch, torch.compile's graphs. Largest shapes first,
    so they start on separate workers."""
    kinds = [("xl_chunk", c) for c in chunks] + ([("limit_chunk", LIMIT_CHUNK)] if limit else [])
    tasks = [{"kind": kind, "S": S, "DK": dk, "DV": dv, "L": L}
             for S in sorted(seqlens, reverse=True) for dk, dv in sorted(dims, key=lambda d: -d[0] * d[1])
             for kind, L in kinds]
    if step:
        tasks.append({"kind": "step"})
    if compile_torch:
        tasks.insert(0, {"kind": "compile"})
    return tasks


def _run_task(torch, task, peers, dev):
    kind = task["kind"]
    if kind == "compile":
        warm_compiled(torch, compiled_parallel(torch), dev)
        return
    if kind == "step":
        fn = step_peer()
        if fn is None:
            return
        for b in STEP_BATCHES:
            r = [torch.randn(b, NH, d, device=dev).to(torch.bfloat16) for d in (STEP_DH, STEP_DH, STEP_DH, 1, 1)]
            C = torch.randn(b, NH, STEP_DH, STEP_DH, device=dev)
            fn(*r, C, torch.randn(b, NH, STEP_DH, device=dev).abs(), torch.randn(b, NH, 1, device=dev))
        return
    fn = peers.get(kind)
    if fn is None:
        return
    S, dk, dv, L = task["S"], task["DK"], task["DV"], task["L"]
    x = [torch.randn(B, NH, S, d, device=dev).to(torch.bfloat16) for d in (dk, dk, dv)]
    x += [torch.randn(B, NH, S, device=dev).to(torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        fn(q=x[0], k=x[1], v=x[2], i=x[3], f=x[4], chunk_size=L)
    leaves = [t.clone().requires_grad_() for t in x]
    fn(q=leaves[0], k=leaves[1], v=leaves[2], i=leaves[3], f=leaves[4], chunk_size=L).backward(torch.ones_like(x[2]))
    torch.cuda.synchronize()


def worker(tasks: list) -> int:
    """Runs each task once (its compiles land in the caches); a failing task is reported and skipped."""
    if not tasks:
        return 0
    import torch

    dev = "cuda"
    peers, _ = chunk_peers()
    failed = 0
    for task in tasks:
        try:
            _run_task(torch, task, peers, dev)
        except Exception as e:  # noqa: BLE001  (the timing process compiles it itself then)
            failed += 1
            print(f"mlstm warm-up {task}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as a script, this folder comes first on sys.path, where jax.py and difflogic.py would shadow
    # those packages (bench.py does the same).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    _llvm_workaround()
    sys.exit(worker(json.loads(sys.argv[1])))
