"""torch glue for the DiffLogic cellular automaton (issue 30): kspec.nn.DiffLogicCA, its step
(difflogic.ca.step.fwd / .bwd) and its rollout with backpropagation through time: T step kernels forward,
T step backward kernels in reverse, the logits' gradients summed over the steps in step order (no atomics
anywhere: the same bits run to run). Python over the registry's step ops, so kspec.call and explain see
the two ops that really run."""
from __future__ import annotations

import torch

from ._core import call

# The architectures the step kernels are compiled for (templates/difflogic/params.h kDiffLogicCaArchs):
# name -> (C, K, perception widths, update widths).
ARCHS = {
    "checkerboard": (8, 16, (8, 4, 2), (256,) * 10 + (128, 64, 32, 16, 8, 8)),
    "tiny": (2, 2, (8, 4, 2), (6, 2)),
}
PASS_THROUGH = 3  # op 3: f(a, b) = a


def arch_name(channels, n_kernels, perceive, update):
    """The compiled architecture with these sizes (kspec.Unsupported-like NotImplementedError otherwise)."""
    want = (int(channels), int(n_kernels), tuple(int(w) for w in perceive), tuple(int(w) for w in update))
    for name, arch in ARCHS.items():
        if arch == want:
            return name
    raise NotImplementedError(
        f"kspec.nn.DiffLogicCA: no compiled architecture has channels={want[0]}, n_kernels={want[1]}, "
        f"perceive={list(want[2])}, update={list(want[3])}; compiled: "
        + "; ".join(f"{n}: channels={a[0]}, n_kernels={a[1]}, perceive={list(a[2])}, update={list(a[3])}"
                    for n, a in ARCHS.items()))


def _check_state(state, C, where):
    if not isinstance(state, torch.Tensor) or state.dim() != 4 or state.shape[-1] != C:
        raise ValueError(f"{where}: state must be a (batch, height, width, {C}) tensor, got "
                         f"{tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
    if not state.dtype.is_floating_point:
        raise ValueError(f"{where}: state must be floating point, got {state.dtype}")


def _check_fire(fire_masks, steps, state, where):
    if fire_masks is None:
        return None
    B, H, W, _ = state.shape
    if not isinstance(fire_masks, torch.Tensor) or tuple(fire_masks.shape) != (steps, B, H, W):
        raise ValueError(f"{where}: fire_masks must be (steps, batch, height, width) = {(steps, B, H, W)}, got "
                         f"{tuple(fire_masks.shape) if isinstance(fire_masks, torch.Tensor) else type(fire_masks).__name__}")
    return fire_masks.to(state.dtype).contiguous()


class _Rollout(torch.autograd.Function):
    """T soft (or hard) steps; backward: the soft step's backward from the last step to the first, its
    state gradient fed to the step before, the logits' gradients summed in step order, then clamped to
    [-clip, clip] (clip None: not)."""

    @staticmethod
    def forward(ctx, state, perception_logits, update_logits, perm, wires, fire, arch, periodic, steps, mode,
                checkpoint, clip):
        states = [state]
        for t in range(steps):
            f = None if fire is None else fire[t]
            states.append(call("difflogic.ca.step.fwd", states[-1], perm, wires, perception_logits, update_logits, f,
                               arch=arch, mode=mode, periodic=periodic)[0])
        # checkpoint: keep the first state only; the backward recomputes the others (one more forward).
        kept = [state] if checkpoint else states[:-1]
        ctx.save_for_backward(perception_logits, update_logits, perm, wires,
                              fire if fire is not None else state.new_empty(0), *kept)
        ctx.meta = (arch, periodic, steps, fire is not None, checkpoint, clip)
        return states[-1]

    @staticmethod
    def backward(ctx, dlast):
        perception_logits, update_logits, perm, wires, fire, *kept = ctx.saved_tensors
        arch, periodic, steps, has_fire, checkpoint, clip = ctx.meta
        fire = fire if has_fire else None
        if checkpoint:
            kept = kept[:1]
            for t in range(steps - 1):
                f = None if fire is None else fire[t]
                kept.append(call("difflogic.ca.step.fwd", kept[-1], perm, wires, perception_logits, update_logits, f,
                                 arch=arch, mode="soft", periodic=periodic)[0])
        d = dlast.contiguous()
        dp = torch.zeros_like(perception_logits)
        du = torch.zeros_like(update_logits)
        for t in reversed(range(steps)):
            f = None if fire is None else fire[t]
            d, gp, gu = call("difflogic.ca.step.bwd", kept[t], perm, wires, perception_logits, update_logits, f, d,
                             arch=arch, periodic=periodic)
            dp += gp
            du += gu
        if clip is not None:
            dp.clamp_(-clip, clip)
            du.clamp_(-clip, clip)
        return d, dp, du, None, None, None, None, None, None, None, None, None


class DiffLogicCA(torch.nn.Module):
    """A DiffLogic cellular automaton (the published notebook's): per cell and channel, n_kernels perception
    kernels (logic networks 9 -> perceive[0] -> ...; the first layer's gate g reads (neighbour perm[g],
    centre), later layers wired by `wires`, shared by the kernels) on the channel's 3x3 patch (zero-padded,
    or wrapped when periodic); the update network (update widths, last = channels) on [state | perception]
    gives the new state. The architecture must be one the kernels are compiled for (ARCHS: the notebook's
    checkerboard C=8, K=16, 9-8-4-2, 264-256x10-128-64-32-16-8-8; tiny for tests).

    Parameters `perception_logits` (K, perception gates, 16) and `update_logits` (update gates, 16), fp32,
    initialised to 0 but pass_value on the pass-through op (3, f(a, b) = a), as the notebook. Buffers
    `perm` (8,) int32 (the neighbours 0..8 but the centre 4, shuffled) and `wires` (2, wired) int32 (each
    layer's a and b rows: every input of a layer read once before any is read twice), drawn from torch's
    CPU generator. grad_clip: the logits' gradients after a rollout are clamped to [-grad_clip, grad_clip]
    (100 as the notebook; None: no clamp). state: (batch, height, width, channels) fp32/bf16 on CUDA (fp16:
    the forward only; the backward refuses it, the state's gradient flushing to zero in fp16)."""

    def __init__(self, channels: int = 8, n_kernels: int = 16, perceive=(8, 4, 2),
                 update=(256,) * 10 + (128, 64, 32, 16, 8, 8), periodic: bool = False, pass_value: float = 10.0,
                 grad_clip: float | None = 100.0, device=None):
        super().__init__()
        self.arch = arch_name(channels, n_kernels, perceive, update)
        self.channels, self.n_kernels = int(channels), int(n_kernels)
        self.perceive, self.update = tuple(perceive), tuple(update)
        self.periodic, self.pass_value, self.grad_clip = bool(periodic), float(pass_value), grad_clip
        gp, gu = sum(self.perceive), sum(self.update)
        self.perception_logits = torch.nn.Parameter(self._init_logits((n_kernels, gp, 16), device))
        self.update_logits = torch.nn.Parameter(self._init_logits((gu, 16), device))
        perm = torch.tensor([0, 1, 2, 3, 5, 6, 7, 8])[torch.randperm(8)]
        rows, n_in = [], self.perceive[0]
        for width in self.perceive[1:]:
            rows.append(self._layer_wires(n_in, width))
            n_in = width
        n_in = channels + channels * self.perceive[-1] * n_kernels
        for width in self.update:
            rows.append(self._layer_wires(n_in, width))
            n_in = width
        self.register_buffer("perm", perm.to(device=device, dtype=torch.int32))
        self.register_buffer("wires", torch.cat(rows, dim=1).to(device=device, dtype=torch.int32))

    def _init_logits(self, shape, device):
        t = torch.zeros(shape, device=device)
        t[..., PASS_THROUGH] = self.pass_value
        return t

    @staticmethod
    def _layer_wires(n_in: int, width: int):
        """(2, width): the 2 width slots cycle over a permutation of the inputs, so every input is read once
        before any is read twice (all of them when 2 width >= n_in), then shuffled over the gates."""
        order = torch.randperm(n_in)
        slots = order[torch.arange(2 * width) % n_in]
        return slots[torch.randperm(2 * width)].reshape(2, width)

    def wiring(self):
        """perm, wires as the ops take them, checked once per wiring (the checks sync with the host)."""
        perm, wires = self.perm, self.wires
        key = tuple((t.data_ptr(), t._version, t.device) for t in (perm, wires))
        if getattr(self, "_checked", None) != key:
            self._check_wiring(perm, wires)
            self._checked = key
        return perm.contiguous(), wires.contiguous()

    def _check_wiring(self, perm, wires):
        if perm.shape != (8,) or sorted(perm.tolist()) != [0, 1, 2, 3, 5, 6, 7, 8]:
            raise ValueError(f"kspec.nn.DiffLogicCA: perm must be a permutation of the neighbours 0..8 but 4, got "
                             f"{perm.tolist()}")
        col, n_in = 0, self.perceive[0]
        widths = list(self.perceive[1:]) + list(self.update)
        n_ins = []
        for w in self.perceive[1:]:
            n_ins.append(n_in)
            n_in = w
        n_in = self.channels + self.channels * self.perceive[-1] * self.n_kernels
        for w in self.update:
            n_ins.append(n_in)
            n_in = w
        total = sum(widths)
        if tuple(wires.shape) != (2, total) or wires.dtype != torch.int32:
            raise ValueError(f"kspec.nn.DiffLogicCA: wires must be (2, {total}) int32, got {tuple(wires.shape)} "
                             f"{wires.dtype}")
        for w, n in zip(widths, n_ins):
            seg = wires[:, col:col + w]
            lo, hi = int(seg.min()), int(seg.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"kspec.nn.DiffLogicCA: wires[:, {col}:{col + w}] (a layer of {w} gates on {n} "
                                 f"inputs) must lie in [0, {n}), got values in [{lo}, {hi}]")
            col += w

    def step(self, state, fire=None, hard: bool = False):
        """One step: (batch, height, width, channels) -> the same; fire (batch, height, width) of 0 / 1."""
        fire_masks = None if fire is None else fire.unsqueeze(0)
        return self.rollout(state, 1, hard=hard, fire_masks=fire_masks)

    def rollout(self, state, steps: int, hard: bool = False, fire_masks=None, checkpoint: bool = False):
        """The state after `steps` steps, differentiable with respect to state and both logits (hard=True:
        the hard forward, no gradient). fire_masks: (steps, batch, height, width) of 0 / 1 or None (every
        cell updates every step). checkpoint: keep the first state only and recompute the others in the
        backward (steps - 1 more step kernels) instead of keeping every step's state."""
        where = "kspec.nn.DiffLogicCA.rollout"
        _check_state(state, self.channels, where)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{where}: steps must be an int >= 1, got {steps!r}")
        fire = _check_fire(fire_masks, steps, state, where)
        perm, wires = self.wiring()
        state = state.contiguous()
        if hard:
            with torch.no_grad():
                for t in range(steps):
                    f = None if fire is None else fire[t]
                    state = call("difflogic.ca.step.fwd", state, perm, wires, self.perception_logits,
                                 self.update_logits, f, arch=self.arch, mode="hard", periodic=self.periodic)[0]
            return state
        return _Rollout.apply(state, self.perception_logits, self.update_logits, perm, wires, fire, self.arch,
                              self.periodic, steps, "soft", bool(checkpoint), self.grad_clip)

    def forward(self, state, steps: int = 1, **kw):
        return self.rollout(state, steps, **kw)

    def extra_repr(self):
        return (f"channels={self.channels}, n_kernels={self.n_kernels}, perceive={list(self.perceive)}, "
                f"update={list(self.update)}, periodic={self.periodic}, arch={self.arch!r}")
