"""What a warm selective_scan training step does on the host at issue 33's small shapes, counted on the mock
CUDA driver (tests/mock_cuda through tools/bench/dispatch_host.py: CPU tensors through the torch extension and
kspec::call, kernels compiled but not run): the plan's launches and nothing else of the driver's (no cuMemAlloc,
free, memset, synchronize or kernel attribute set per step), no kernel compiled or looked up per step (a plan
built for kernels not yet loaded would count; the call cache's hits and misses are not counted), the outputs and
gradients as 11 allocations and no fill or copy, and the same Python path at every shape. The H100's fwd+bwd
"ev" at 1x2048x512 and 16x768x256 was ~130 µs over 2x4096x333's (tools/bench/NOTES.md): this pins that kspec's
and autograd's host work does not depend on the shape (tools/gpu/profile_scan_host.py looks at the rest)."""
import pytest

from helpers import run_on_mock_driver

torch = pytest.importorskip("torch")


_BODY = r"""
import collections, ctypes, json
import torch, kspec, kspec._torch
from torch.profiler import ProfilerActivity, profile
dh.install_shim(shim)
lib = ctypes.CDLL(mock)
lib.kspec_mock_count.restype = ctypes.c_longlong
lib.kspec_mock_count.argtypes = [ctypes.c_char_p]
DRIVER = ("launches", "allocs", "frees", "syncs", "memsets", "attribute_sets")
KSPEC = ("compiled", "disk_hits", "memory_hits")

def counts():
    c = {k: lib.kspec_mock_count(k.encode()) for k in DRIVER}
    c.update({k: kspec.counters()[k] for k in KSPEC})
    return c

result = {}
for shape in SHAPES:
    b, d, t = shape
    n, bf = 16, torch.bfloat16
    leaves = [torch.randn(b, d, t, dtype=bf), torch.rand(b, d, t, dtype=bf), -torch.rand(d, n),
              torch.randn(b, 1, n, t, dtype=bf), torch.randn(b, 1, n, t, dtype=bf), torch.randn(d),
              torch.randn(b, d, t, dtype=bf), torch.randn(d) * 0.1]
    leaves = [v.requires_grad_() for v in leaves]
    dout = torch.randn(b, d, t, dtype=bf)

    def step():
        for v in leaves:
            v.grad = None
        kspec.ops.selective_scan_fn(*leaves, delta_softplus=True).backward(dout)

    for _ in range(3):
        step()
    before = counts()
    for _ in range(4):
        step()
    after = counts()
    per_step = {k: (after[k] - before[k]) / 4 for k in after}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    aten = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    names = []
    def hook(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)
    sys.setprofile(hook)
    step()
    sys.setprofile(None)
    result["x".join(map(str, shape))] = dict(per_step=per_step, aten=dict(aten), python=names[:-1])
# tools/gpu/profile_scan_host.py --split: its hooks reach the node and the registry call, in order, and come off
sys.path.insert(0, gpu_tools)
import profile_scan_host as psh
surf = kspec._torch.selective_scan
family = surf.family
clock, undo = psh.kspec_clock()
step()
order = sorted(clock.marks, key=clock.marks.get)
undo()
step()
result["split"] = dict(order=order, calls=clock.calls, restored=surf.family is family and
                       "_native_backward" not in vars(surf))
# --probe's floor, a no-op autograd.Function of the scan's inputs: torch's engine alone, no launch, and the
# allocations of kspec's step (out, 8 gradients) less last_state and states
def noop_step():
    for v in leaves:
        v.grad = None
    psh.NoopScan.apply(*leaves).backward(dout)
noop_step()
before = counts()
noop_step()
after = counts()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    noop_step()
result["noop"] = dict(launches=after["launches"] - before["launches"], grads=all(v.grad is not None for v in leaves),
                      aten=sorted({e.name for e in prof.events() if e.name.startswith("aten::")}))
print(json.dumps(result))
print("ok")
"""

# (shape, launches per step): the forward's kernel (tile at 1x2048x512, wide at 16x768x256, sequential at
# 2x4096x333), then the backward's main kernel and the reduce; at 1x2048x512 the backward's few-channels plan
# also runs its segments' adjoint pass (4 segments). No zeroing of the variable dB/dC accumulators: the
# reduce leaves them zero for the next step (its own buffer, zeroed by a memset when allocated: in warm-up).
SHAPES = {(2, 4096, 333): 3, (1, 2048, 512): 4, (16, 768, 256): 3}


def test_warm_scan_step_host_work_does_not_depend_on_the_shape():
    r = run_on_mock_driver(_BODY, f"SHAPES = {list(SHAPES)!r}\n")
    import json

    got = json.loads(r.stdout.strip().splitlines()[-2])
    paths = set()
    for shape, launches in SHAPES.items():
        g = got["x".join(map(str, shape))]
        assert g["per_step"] == {"launches": launches, "allocs": 0, "frees": 0, "syncs": 0, "memsets": 0,
                                 "attribute_sets": 0, "compiled": 0, "disk_hits": 0, "memory_hits": 0}, (shape, g)
        # out, last_state, states and 8 gradients (no dh0): no zeros, fill, copy or clone beside them
        assert g["aten"] == {"aten::empty": 11, "aten::detach": 8}, (shape, g["aten"])
        paths.add(tuple(g["python"]))
    assert len(paths) == 1, "the Python path of a step differs between shapes"
    assert got["split"] == {"order": ["node", "call", "call_end", "node_end"], "calls": 2, "restored": True}, got["split"]
    # the probe's floor launches nothing and only allocates (no copy of a gradient by AccumulateGrad)
    noop = got["noop"]
    assert noop["launches"] == 0 and noop["grads"], noop
    assert set(noop["aten"]) <= {"aten::empty_like", "aten::empty", "aten::empty_strided", "aten::detach"}, noop


_PROBE = r"""
import torch, kspec
dh.install_shim(shim)
sys.path.insert(0, gpu_tools)
import profile_scan_host as psh


class Event:  # CPU tensors: nothing to time on a device
    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class Stream:
    cuda_stream = 0

    def synchronize(self):
        pass


torch.cuda.synchronize = lambda: None
torch.cuda._sleep = lambda cycles: None
torch.cuda.Event = Event
torch.cuda.current_stream = Stream
torch.cuda.empty_cache = lambda: None
lib = ctypes.CDLL(mock)
lib.kspec_mock_count.restype = ctypes.c_longlong
lib.kspec_mock_count.argtypes = [ctypes.c_char_p]
before = lib.kspec_mock_count(b"launches")
psh.probe_shape("1x64x512", dev="cpu", libcuda=mock, flush_words=1024)
print("launches", lib.kspec_mock_count(b"launches") - before)
print("ok")
"""


def test_probe_runs_on_the_mock_driver():
    """profile_scan_host.py --probe end to end on the mock driver (CPU tensors, torch.cuda's timing calls
    stubbed): every row prints, the empty kernel is launched through the driver (ctypes), and the steps run."""
    r = run_on_mock_driver(_PROBE)
    rows = r.stdout.splitlines()
    for name in ("python no-op", "raw cuLaunchKernel, empty kernel", "kspec.call fwd, out given",
                 "kspec.call bwd, out given"):
        row = next(line for line in rows if name in line)
        assert len(row.split("|")) == 1 + 7, row  # one column per GPU/host state
    steps = [line for line in rows if " probe step " in line]
    assert len(steps) >= 2 and "no-op autograd.Function" in steps[0] and "kspec selective_scan_fn" in steps[1], rows
    # every probe call and step launches: the empty kernel, kspec's forward and backward, the kspec steps
    assert int(next(line for line in rows if line.startswith("launches")).split()[1]) > 1000, rows
