"""torch glue for difflogic (issue 30): the logic layer's family spec (kspec._surface makes the custom ops
kspec::logic_layer_fwd/_bwd, fakes, autograd and the eager path), the wiring (int32 wires checked once, and
the consumers CSR the backward reads, built on the device once per wiring), the packed inference op and
the bit packing around it (torch ops: no kernel of kspec's), and the modules kspec.nn.LogicLayer and
kspec.nn.GroupSum with difflogic 0.1.0's parameters, wiring and modes.

Layouts: the layer's fast kernels are feature-major (a gate reads two contiguous rows of x.t()). A row-major
x (what a plain model hands over) is by default transposed once to that layout (kspec's tiled transpose,
difflogic.transpose: x read and written once at streaming speed) instead of running the row-major kernels,
which gather x[s, a_g] at random within a row (a 32-byte sector through L2 for each 4-byte element, and the
backward's dlogits and dx gather x and dout the same way: 25.9 ms fwd+bwd against 2.9 ms feature-major at
16384 x 16000 -> 16000 fp32 on the H100). y comes back feature-major (a (batch, n_out) view), so a following
layer pays no transpose; in the backward a row-major dy is transposed once, and dx goes back to x's layout.
Where no gradient is wanted (inference, eval, torch.no_grad) "auto" instead runs the row-major forward op,
whose staged kernel reads x once (whole rows of x in shared memory, templates/difflogic/layer_staged.cuh):
x and y once each, without the transpose's extra read and write of x, where enough rows fit (stage_pays);
y row-major. row_major="staged" does that in training too, the staged kernel then also writing x transposed
from its shared memory (the forward op's save_xt: 3X where the transpose path's forward moves 4X), which the
backward reads; the backward transposes a row-major dy as "auto"'s does."""
from __future__ import annotations

import torch

from ._core import call
from ._surface import Family, build

MODES = ("soft", "hard")


def check_wires(n_in: int, a, b, where: str = "kspec.ops.logic_layer"):
    """int32 contiguous copies of the wires, after checking them (one host sync: done once per wiring)."""
    for name, w in (("a", a), ("b", b)):
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            raise ValueError(f"{where}: wire '{name}' must be a 1-d integer tensor (n_out,), got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        if w.dtype.is_floating_point or w.dtype == torch.bool:
            raise ValueError(f"{where}: wire '{name}' must be an integer tensor, got {w.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"{where}: wires 'a' {tuple(a.shape)} and 'b' {tuple(b.shape)} must have one length (n_out)")
    if a.numel() and not torch.compiler.is_compiling():  # a value check syncs: not in a compiled graph
        lo, hi = int(torch.minimum(a.min(), b.min())), int(torch.maximum(a.max(), b.max()))
        if lo < 0 or hi >= n_in:
            raise ValueError(f"{where}: wires must lie in [0, n_in) = [0, {n_in}), got values in [{lo}, {hi}]")
    return a.to(torch.int32).contiguous(), b.to(torch.int32).contiguous()


def consumers(n_in: int, a, b):
    """The backward's consumers CSR of a wiring, int32 on the wires' device: offsets [n_in + 1], then for
    each input its readers 2 g + side in ascending order [2 n_out] (kspec.reference.difflogic.consumers)."""
    reader = torch.stack([a, b], dim=1).reshape(-1).long()  # reader[2 g + side] = the input it reads
    ordered, entries = torch.sort(reader, stable=True)
    # offsets[j] = readers of inputs below j; searchsorted, not bincount: static shapes under torch.compile
    offsets = torch.searchsorted(ordered, torch.arange(n_in + 1, device=a.device))
    return torch.cat([offsets, entries]).to(torch.int32)


def feature_major(t) -> bool:
    """Whether a (batch, n) tensor is the transpose of a contiguous (n, batch) one (strides (1, batch)), the
    layout difflogic keeps: the layer then runs its feature-major kernels and returns y (and dx) the same
    way, so a stack of layers fed x.t() stays feature-major. With batch or n of 1 both layouts coincide
    (row-major is used)."""
    return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) == 1 and t.stride(1) == t.shape[0]


ROW_MAJOR = ("auto", "transpose", "direct", "staged")


# The staged forward's rows a pass: as many as fit a block's shared memory, at most 8 (op.cpp kStagedMaxRows).
STAGED_MAX_ROWS = 8
# ... times the element size, at least this many bytes for "auto" to take it over the transpose path.
STAGED_MIN_PASS_BYTES = 8


def stage_pays(x) -> bool:
    """Whether "auto" runs difflogic.layer.fwd's staged kernel on x rather than transposing x: by bytes. It moves
    x and y once (2X, X = x's bytes) against the transpose path's 4X, but reads every gate's wires and T (24 B)
    from L2 once a pass: 24 / rows bytes an output beside 2 (halves) or 4 (fp32) of DRAM. With 8 bytes of
    activations a pass or more (fp32 from 2 rows: 16k fp32 holds 3 in the H100's 227 KB; halves from 4: 16k
    holds 7) that costs less than the transpose's 2X; below (32k fp32 and 64k halves: 1 row) it costs more.
    No row fits at all (64k fp32): the op would fall back to its flat kernel."""
    if not x.is_cuda:
        return False
    return staged_pass_pays(x.shape[1], x.element_size(),
                            torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin)


def staged_pass_pays(n_in: int, element_size: int, smem_per_block: int) -> bool:
    """stage_pays's rule: rows a pass (of n_in elements, in smem_per_block bytes) x element_size >= 8 bytes."""
    rows = min(STAGED_MAX_ROWS, smem_per_block // (n_in * element_size))
    return rows * element_size >= STAGED_MIN_PASS_BYTES


# Where staging does not pay (stage_pays false: 64k fp32 has no whole row in shared memory, 32k fp32 and 64k
# halves one), a forward without a gradient may run difflogic.layer.fwd's hybrid kernel (config stage 8,
# templates/difflogic/layer_hybrid.cuh: a row's first columns in shared memory, the rest from L1/L2; x and y
# once each) instead of the transpose path (4X). Off until the H100 times it against the transpose path
# (tools/bench/NOTES.md, h-dl11: the bench's "kspec staged hybrid" fwd row against "kspec").
HYBRID_IN_AUTO = False
HYBRID_FWD_CONFIG = "threads=256,lanes=0,stage=8"


def runs_hybrid(x, row_major: str, grad: bool) -> bool:
    """Whether "auto" runs the hybrid forward on this x: HYBRID_IN_AUTO, no gradient wanted, a row-major x
    outside torch.compile where the staged kernel does not pay."""
    return (HYBRID_IN_AUTO and row_major == "auto" and not grad and _row_major_proper(x)
            and not torch.compiler.is_compiling() and not stage_pays(x))


def wants_grad(x, logits) -> bool:
    """Whether autograd will ask this layer for a backward."""
    return torch.is_grad_enabled() and (x.requires_grad or logits.requires_grad)


def transpose(t):
    """t (rows, cols) contiguous -> (cols, rows) contiguous, bit for bit (difflogic.transpose: 64 x 64 tiles
    through shared memory, every global access along a row)."""
    return call("difflogic.transpose", t)[0]


class _RowMajorLayer(torch.autograd.Function):
    """The layer on a row-major x through the feature-major kernels: x transposed once (kept for the
    backward, as the layer keeps its x), y feature-major; the backward transposes a row-major dy once and
    writes dx row-major itself (layer.bwd's dx_layout row_major: no transpose of dx afterwards)."""

    @staticmethod
    def forward(ctx, x, logits, a, b, csr, mode, grad_factor):
        xf = transpose(x).t()
        ctx.save_for_backward(xf, logits, a, b, csr)
        ctx.grad_factor = grad_factor
        return _layer_fwd(xf, logits, a, b, csr, mode, grad_factor, save=True)[0]

    @staticmethod
    def backward(ctx, dy):
        xf, logits, a, b, csr = ctx.saved_tensors
        dx, dlogits = call("difflogic.layer.bwd", xf, logits, a, b, _feature_major_dy(dy), csr,
                           grad_factor=ctx.grad_factor, layout="feature_major", dx_layout="row_major",
                           out=(xf.new_empty(xf.shape), torch.empty_like(logits)))
        return dx, dlogits, None, None, None, None, None


class _StagedRowMajorLayer(torch.autograd.Function):
    """row_major="staged" with a gradient wanted: the forward reads the row-major x once (the row-major forward
    op's staged kernel, y row-major) and writes x transposed from its shared memory beside y (save_xt: the x the
    feature-major backward reads, kept instead of x); the backward transposes a row-major dy once and runs the
    feature-major backward, dx written row-major (layer.bwd's dx_layout row_major). Bytes a step, X = x's: the
    forward 3X (x, y, xt) where the transpose path moves 4X (the transpose 2X, then x^T and y)."""

    @staticmethod
    def forward(ctx, x, logits, a, b, csr, mode, grad_factor):
        y, xt = call("difflogic.layer.fwd", x, logits, a, b, mode=mode, save_xt=True)
        ctx.save_for_backward(xt, logits, a, b, csr)
        ctx.grad_factor = grad_factor
        return y

    @staticmethod
    def backward(ctx, dy):
        xt, logits, a, b, csr = ctx.saved_tensors
        xf = xt.t()
        dx, dlogits = call("difflogic.layer.bwd", xf, logits, a, b, _feature_major_dy(dy), csr,
                           grad_factor=ctx.grad_factor, layout="feature_major", dx_layout="row_major",
                           out=(xf.new_empty(xf.shape), torch.empty_like(logits)))
        return dx, dlogits, None, None, None, None, None


def _like_x(x, n):
    """An empty (batch, n) tensor in x's layout."""
    if feature_major(x):
        return torch.empty(n, x.shape[0], dtype=x.dtype, device=x.device).t()
    return x.new_empty((x.shape[0], n))


def _layer_fwd(x, logits, a, b, csr, mode, grad_factor, save):
    if feature_major(x):
        return call("difflogic.layer.fwd", x, logits, a, b, mode=mode, layout="feature_major",
                    out=(_like_x(x, a.shape[0]), None))[:1]
    return call("difflogic.layer.fwd", x, logits, a, b, mode=mode)[:1]  # y (xt: only with save_xt)


def _feature_major_dy(dy):
    """dy in the feature-major layout: a row-major one (the loss's) transposed once (an expanded one, as
    sum().backward() gives, by torch's copy)."""
    if feature_major(dy):
        return dy
    return transpose(dy).t() if dy.is_contiguous() else dy.t().contiguous().t()


def _layer_bwd(dy, x, logits, a, b, csr, grad_factor):
    if feature_major(x):
        dy = _feature_major_dy(dy)
        return call("difflogic.layer.bwd", x, logits, a, b, dy, csr, grad_factor=grad_factor, layout="feature_major",
                    out=(_like_x(x, x.shape[1]), torch.empty_like(logits)))
    return call("difflogic.layer.bwd", x, logits, a, b, dy.contiguous(), csr, grad_factor=grad_factor)


layer = build(Family(
    name="logic_layer", ops=("difflogic.layer.fwd", "difflogic.layer.bwd"),
    fwd="Tensor x, Tensor logits, Tensor a, Tensor b, Tensor consumers, str mode, float grad_factor", fwd_out=("y",),
    bwd="Tensor dy, Tensor x, Tensor logits, Tensor a, Tensor b, Tensor consumers, float grad_factor",
    bwd_out=("dx", "dlogits"), forward=_layer_fwd, backward=_layer_bwd,
    fake=lambda x, logits, a, *_: (_like_x(x, a.shape[0]),),
    bwd_fake=lambda dy, x, logits, *_: (_like_x(x, x.shape[1]), logits.new_empty(logits.shape))))


def _row_major_proper(x) -> bool:
    """A row-major x of more than one sample and one input (either layout otherwise, nothing to gain)."""
    return not feature_major(x) and x.dim() == 2 and x.shape[0] > 1 and x.shape[1] > 1


def transposes(x, row_major: str = "auto", grad: bool = True) -> bool:
    """Whether the layer transposes this x to the feature-major layout first: a row-major x (_row_major_proper)
    with row_major "transpose", or "auto" outside torch.compile (under it "auto" keeps the row-major kernels:
    one traced graph as before) where a gradient is wanted (grad) or the staged forward does not pay
    (stage_pays)."""
    if not _row_major_proper(x):
        return False
    if row_major == "transpose":
        return True
    return row_major == "auto" and not torch.compiler.is_compiling() and (grad or not stage_pays(x))


def logic_layer(x, logits, a, b, *, mode: str = "soft", grad_factor: float = 1.0, consumers_csr=None,
                row_major: str = "auto"):
    if mode not in MODES:
        raise ValueError(f"kspec.ops.logic_layer: mode must be one of {MODES}, got {mode!r}")
    if row_major not in ROW_MAJOR:
        raise ValueError(f"kspec.ops.logic_layer: row_major must be one of {ROW_MAJOR}, got {row_major!r}")
    if x.dim() != 2:
        raise ValueError(f"kspec.ops.logic_layer: x must be (batch, n_in), got {tuple(x.shape)}")
    if a.dtype != torch.int32 or b.dtype != torch.int32 or consumers_csr is None:
        a, b = check_wires(x.shape[1], a, b)
    if consumers_csr is None:
        consumers_csr = consumers(x.shape[1], a, b)
    grad = wants_grad(x, logits)
    if row_major == "staged" and not stage_pays(x):  # no rows to stage (64k fp32): the flat gather would run
        row_major = "auto"
    if runs_hybrid(x, row_major, grad):
        return call("difflogic.layer.fwd", x.contiguous(), logits, a, b, mode=mode, config=HYBRID_FWD_CONFIG)[0]
    if row_major == "staged" and grad and _row_major_proper(x) and not torch.compiler.is_compiling():
        return _StagedRowMajorLayer.apply(x.contiguous(), logits, a, b, consumers_csr, mode, float(grad_factor))
    if transposes(x, row_major, grad):
        if torch.compiler.is_compiling():  # torch's copy, traced like any torch op, then the feature-major path
            return layer(x.t().contiguous().t(), logits, a, b, consumers_csr, mode, float(grad_factor))
        return _RowMajorLayer.apply(x.contiguous(), logits, a, b, consumers_csr, mode, float(grad_factor))
    if not (x.is_contiguous() or feature_major(x)):
        x = x.contiguous()
    return layer(x, logits, a, b, consumers_csr, mode, float(grad_factor))


def _group_sum_bwd(dy, x, tau):
    B, k, m = x.shape
    return call("difflogic.group_sum.bwd", dy[:, :, None].expand(B, k, m), tau=tau, out=(x.new_empty(x.shape),))


# GroupSum on x (batch, k, m): y (batch, k) = the groups' sums / tau; dx = dy expanded over m / tau (no copy
# of dy: the backward op reads it with stride 0).
group_sum_surface = build(Family(
    name="group_sum", ops=("difflogic.group_sum.fwd", "difflogic.group_sum.bwd"),
    fwd="Tensor x, float tau", fwd_out=("y",), bwd="Tensor dy, Tensor x, float tau", bwd_out=("dx",),
    backward=_group_sum_bwd, bwd_fake=lambda dy, x, tau: (x.new_empty(x.shape),)))


def group_sum(x, k: int, tau: float = 1.0):
    """GroupSum(k, tau) on kspec's kernels: x (..., n) -> (..., k), the sums of k equal groups of n / k divided
    by tau (x's dtype), differentiable."""
    if x.dim() < 1 or k < 1 or x.shape[-1] % k:
        raise ValueError(f"kspec.ops.group_sum: the last dim of x {tuple(x.shape)} must be a multiple of k = {k}")
    lead = x.shape[:-1]
    y = group_sum_surface(x.reshape(-1, k, x.shape[-1] // k).contiguous(), float(tau))
    return y.reshape(*lead, k)


# ---- bit packing and packed inference (forward only) ----

_WORD = {32: torch.int32, 64: torch.int64}


def _word_dtype(w: int):
    if w not in _WORD:
        raise ValueError(f"kspec.ops.difflogic_pack: word width w must be 32 or 64, got {w}")
    return _WORD[w]


def pack(x, w: int = 32):
    """{0,1} (or bool) [B, n] -> words [n, ceil(B / w)] int32 (w = 32) or int64 (w = 64): sample s is bit
    s mod w of word s // w; the last word's padding bits are 0."""
    dtype = _word_dtype(w)
    B, n = x.shape
    words = -(-B // w)
    bits = torch.zeros((words * w, n), dtype=torch.int64, device=x.device)
    bits[:B] = (x != 0).to(torch.int64)
    shifts = torch.arange(w, device=x.device, dtype=torch.int64)
    packed = (bits.reshape(words, w, n) << shifts[None, :, None]).sum(dim=1)  # disjoint bits: sum == or
    if w == 32:  # the int32 word's bit pattern (bit 31 is the sign)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.t().contiguous().to(dtype)


def unpack(words, batch: int):
    """words [n, ceil(B / w)] -> {0,1} [B, n] uint8 (pack's inverse)."""
    w = 64 if words.dtype == torch.int64 else 32
    shifts = torch.arange(w, device=words.device, dtype=torch.int64)
    bits = (words.to(torch.int64)[:, :, None] >> shifts) & 1  # arithmetic shift: bit w-1 comes out as 1
    return bits.reshape(words.shape[0], -1)[:, :batch].t().to(torch.uint8).contiguous()


def packed_layer(words, logits, a, b, batch: int):
    """One hard layer on packed samples (difflogic.packed.fwd): words [n_in, ceil(batch / w)] int32/int64 ->
    [n_out, ceil(batch / w)] of the same dtype; each gate runs its logits' argmax op bitwise."""
    a, b = check_wires(words.shape[0], a, b, "kspec.ops.difflogic_packed")
    return call("difflogic.packed.fwd", words, logits, a, b, batch=int(batch))[0]


def packed_group_sum(words, batch: int, k: int):
    """Packed GroupSum: counts of set bits per group [batch, k] (int64) of words [n, ceil(batch / w)]."""
    n = words.shape[0]
    if k < 1 or n % k:
        raise ValueError(f"kspec.ops.difflogic_packed_group_sum: k = {k} must be >= 1 and divide n = {n}")
    return unpack(words, batch).to(torch.int64).reshape(batch, k, n // k).sum(-1)


def packed_net(words, layers, batch: int, k: int, config: str | None = None):
    """A whole packed network in one op (difflogic.packed.net): words [n_in, ceil(batch / w)] int32/int64
    through the hard layers `layers` [(logits (n_l, 16) fp32, a, b (n_l,) wires), ...] (1 to 16 of them),
    then GroupSum's counts [batch, k] int32 of the last layer. config: e.g. "algo=chunked,chunk=64,inflight=2"
    (one launch over chunks of the samples, each chunk's layers in L2) or "algo=layers,chunk=128,inflight=2" (a
    launch per layer; chunk and inflight at their canonical values); None: the op's default."""
    n_in = words.shape[0]
    logits, wa, wb = [], [], []
    for i, (lg, a, b) in enumerate(layers):
        a, b = check_wires(n_in, a, b, f"kspec.ops.difflogic_packed_net: layer {i}")
        logits.append(lg)
        wa.append(a)
        wb.append(b)
        n_in = lg.shape[0]
    counts = torch.empty(batch, k, dtype=torch.int32, device=words.device)
    return call("difflogic.packed.net", words, logits, wa, wb, config=config, out=(counts,))[0]


# ---- modules ----

class LogicLayer(torch.nn.Module):
    """difflogic 0.1.0's LogicLayer on kspec's kernels: y[:, g] = sum_i p_i op_i(x[:, a_g], x[:, b_g]).

    x: (batch, in_dim) fp32/fp16/bf16 on CUDA -> y (batch, out_dim) in x's dtype. x.t() of a contiguous
    (in_dim, batch) (difflogic's layout) runs the feature-major kernels directly; a row-major x is transposed
    to it once first (row_major="auto", the default, or "transpose"); either way y is feature-major, a view of
    a contiguous (out_dim, batch), so a stack of layers transposes once, at its first layer (dx goes back in
    x's layout). Without a gradient (eval, torch.no_grad) "auto" runs the row-major forward instead, which
    reads x once (whole rows in shared memory) and gives y row-major. row_major="direct" (and "auto" under
    torch.compile): the row-major kernels, y row-major; "staged": the row-major forward in training too, writing
    x transposed for the backward beside y (dy transposed in the backward), where staging pays (else as "auto").
    Parameter `weights` (out_dim, 16) (randn, as difflogic's), buffer `indices` (2, out_dim) int64: the
    wiring, drawn as difflogic draws it (the same torch seed gives the same weights and wiring) and kept in
    the state dict. Training: the soft layer; eval: the hard one (argmax op, ties to the lower index).
    straight_through=True: the hard forward in training too, with the soft backward. grad_factor scales dx
    only. implementation: accepted for
    difflogic's signature ("cuda" or None; kspec's kernels run either way)."""

    def __init__(self, in_dim: int, out_dim: int, device="cuda", grad_factor: float = 1.0, implementation=None,
                 connections: str = "random", straight_through: bool = False, row_major: str = "auto"):
        super().__init__()
        if row_major not in ROW_MAJOR:
            raise ValueError(f"kspec.nn.LogicLayer: row_major must be one of {ROW_MAJOR}, got {row_major!r}")
        if implementation not in (None, "cuda"):
            raise ValueError(f"kspec.nn.LogicLayer: implementation must be None or 'cuda', got {implementation!r}")
        if connections != "random":
            raise NotImplementedError(f"kspec.nn.LogicLayer: connections={connections!r}: only 'random' (pass a "
                                      "wiring with set_wiring)")
        if 2 * out_dim < in_dim:
            raise ValueError(f"kspec.nn.LogicLayer: out_dim = {out_dim} gates read at most {2 * out_dim} inputs, fewer "
                             f"than in_dim = {in_dim}")
        self.in_dim, self.out_dim = in_dim, out_dim
        self.grad_factor = grad_factor
        self.straight_through = straight_through
        self.row_major = row_major
        self.weights = torch.nn.Parameter(torch.randn(out_dim, 16, device=device))
        # difflogic's draw, on the CPU generator: a permutation of 2 out_dim slots onto the inputs (each input
        # read about equally often), the inputs themselves permuted.
        slots = torch.randperm(2 * out_dim) % in_dim
        wires = torch.randperm(in_dim)[slots].reshape(2, out_dim)
        self.register_buffer("indices", wires.to(device=device, dtype=torch.int64))
        self._wiring = None  # (indices' data_ptr, version) -> (a, b, consumers)

    def set_wiring(self, a, b):
        """Replaces the wiring (checked now: (out_dim,) each, in [0, in_dim))."""
        a32, b32 = check_wires(self.in_dim, a, b, "kspec.nn.LogicLayer.set_wiring")
        if a32.numel() != self.out_dim:
            raise ValueError(f"kspec.nn.LogicLayer.set_wiring: wires must have out_dim = {self.out_dim} entries, got "
                             f"{a32.numel()}")
        with torch.no_grad():
            self.indices.copy_(torch.stack([a32, b32]).to(self.indices))

    def wiring(self):
        """(a, b int32, consumers CSR) of the current `indices`, checked and built once per wiring."""
        key = (self.indices.data_ptr(), self.indices._version, self.indices.device)
        if self._wiring is None or self._wiring[0] != key:
            a, b = check_wires(self.in_dim, self.indices[0], self.indices[1], "kspec.nn.LogicLayer")
            self._wiring = (key, (a, b, consumers(self.in_dim, a, b)))
        return self._wiring[1]

    def forward(self, x):
        if x.dim() != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"kspec.nn.LogicLayer: x must be (batch, {self.in_dim}), got {tuple(x.shape)}")
        a, b, csr = self.wiring()
        mode = "soft" if self.training and not self.straight_through else "hard"
        return logic_layer(x, self.weights, a, b, mode=mode, grad_factor=self.grad_factor, consumers_csr=csr,
                           row_major=self.row_major)

    def extra_repr(self):
        return f"{self.in_dim}, {self.out_dim}, {'train' if self.training else 'eval'}"


class GroupSum(torch.nn.Module):
    """difflogic's GroupSum: x (..., n) -> (..., k), the sums of k equal groups of n / k divided by tau."""

    def __init__(self, k: int, tau: float = 1.0, device=None):
        super().__init__()
        self.k, self.tau = k, tau

    def forward(self, x):
        if x.shape[-1] % self.k:
            raise ValueError(f"kspec.nn.GroupSum: the last dim {x.shape[-1]} is not a multiple of k = {self.k}")
        if x.is_cuda:  # kspec's kernels (difflogic.group_sum.fwd / .bwd); elsewhere torch's sum
            return group_sum(x, self.k, self.tau)
        return x.reshape(*x.shape[:-1], self.k, x.shape[-1] // self.k).sum(-1) / self.tau

    def extra_repr(self):
        return f"k={self.k}, tau={self.tau}"


def from_difflogic(model):
    """A copy of a difflogic model (a module tree) on kspec's layers: each difflogic LogicLayer becomes a
    kspec LogicLayer with its weights and wiring (and grad_factor, training mode), each GroupSum kspec's;
    every other module is kept (a shallow copy: its parameters are shared). The model is not changed."""
    import copy

    def convert(m):
        kind = type(m).__name__
        if kind == "LogicLayer" and not isinstance(m, LogicLayer):
            out = LogicLayer.__new__(LogicLayer)
            torch.nn.Module.__init__(out)
            out.in_dim, out.out_dim, out.grad_factor, out.straight_through = m.in_dim, m.out_dim, m.grad_factor, False
            out.row_major = "auto"
            out.weights = torch.nn.Parameter(m.weights.detach().clone(), requires_grad=m.weights.requires_grad)
            out.register_buffer("indices", torch.stack([w.detach().to(torch.int64) for w in m.indices]).clone())
            out._wiring = None
            out.wiring()  # checks the wiring now
            return out.train(m.training)
        if kind == "GroupSum" and not isinstance(m, GroupSum):
            return GroupSum(m.k, m.tau).train(m.training)
        m = copy.copy(m)
        m._modules = {name: None if c is None else convert(c) for name, c in m._modules.items()}
        return m

    return convert(model)
