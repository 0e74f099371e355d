"""Float64 NumPy reference for differentiable logic gate networks (difflogic, NeurIPS 2022; issue 30).

The twin of api/ops/difflogic/reference.cpp (same maths, same layouts, same orders). Shapes: x (B, n_in);
logits (n_out, 16); wires a, b (n_out,) int in [0, n_in) (repeats and a[g] == b[g] allowed); y, dout
(B, n_out). Gate op i is truth table i = 8 f(0,0) + 4 f(0,1) + 2 f(1,0) + f(1,1). Per gate
T = p . truth table = (T00, T01, T10, T11), p = softmax(logits) (soft) or one-hot argmax, ties to the
lower index (hard), and
    y = T00 (1-a)(1-b) + T01 (1-a) b + T10 a (1-b) + T11 a b,   a = x[:, a_g], b = x[:, b_g].
Backward of sum(dout * y) (soft; also the straight-through estimator's, whose forward is hard):
    dlogits[g, i] = sum_s dout p_i (op_i - y)      dx = grad_factor * sum over each input's readers,
the readers in the consumers CSR's order (2 g + side ascending; a self-paired gate gives da + db).
GroupSum(k, tau): contiguous groups of n/k, sums / tau. Packed: {0,1} (B, n) -> words (n, ceil(B/w)),
w = 32 or 64, sample s in bit s mod w of word s // w, padding bits zero; packed GroupSum counts bits;
difflogic.pack packs binarize(x) (1 where x > 0.5).
Gumbel noise for the straight-through estimator (hard forward, soft backward, both on logits + G):
G[g, i] = -log(-log U), U = ((r >> 8) + 0.5) 2^-24 with r word i mod 4 of Philox4x32-10 at key
(seed low, seed high), counter (g low, g high, i // 4, 0) (gumbel_noise; the kernels' philox.cuh).
"""

import numpy as np

N_OPS = 16

# The multilinear extensions, as the issue lists them: the independent statement of each op.
OPS = (
    lambda a, b: 0.0 * a,
    lambda a, b: a * b,
    lambda a, b: a - a * b,
    lambda a, b: a + 0.0 * b,
    lambda a, b: b - a * b,
    lambda a, b: b + 0.0 * a,
    lambda a, b: a + b - 2 * a * b,
    lambda a, b: a + b - a * b,
    lambda a, b: 1 - (a + b - a * b),
    lambda a, b: 1 - (a + b - 2 * a * b),
    lambda a, b: 1 - b + 0.0 * a,
    lambda a, b: 1 - b + a * b,
    lambda a, b: 1 - a + 0.0 * b,
    lambda a, b: 1 - a + a * b,
    lambda a, b: 1 - a * b,
    lambda a, b: 1.0 + 0.0 * a,
)

# TRUTH[i, 2u + v] = f_i(u, v): bit 3 - (2u + v) of i.
TRUTH = np.array([[(i >> (3 - uv)) & 1 for uv in range(4)] for i in range(N_OPS)], dtype=np.float64)


_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011) on uint64 arrays holding 32-bit words: counter (4, ...) and
    key (2, ...), broadcast together; returns (4, ...)."""
    c = [np.asarray(v, dtype=np.uint64) for v in counter]
    k0, k1 = (np.asarray(v, dtype=np.uint64) for v in key)
    for _ in range(10):
        p0 = np.uint64(_M0) * c[0]
        p1 = np.uint64(_M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & np.uint64(_MASK), (p0 >> np.uint64(32)) ^ c[3] ^ k1,
             p0 & np.uint64(_MASK)]
        k0 = (k0 + np.uint64(_W0)) & np.uint64(_MASK)
        k1 = (k1 + np.uint64(_W1)) & np.uint64(_MASK)
    return np.stack(np.broadcast_arrays(*c))


def gumbel_noise(n_out, seed):
    """G (n_out, 16): the Gumbel noise the layer adds to its logits with gumbel=True."""
    g = np.arange(n_out, dtype=np.uint64)[:, None]
    block = np.arange(4, dtype=np.uint64)[None, :]
    seed = int(seed)
    key = (np.uint64(seed & _MASK), np.uint64(seed >> 32))
    r = philox4x32_10((g & np.uint64(_MASK), g >> np.uint64(32), block, np.zeros_like(block)), key)  # (4, n, 4)
    words = np.moveaxis(r, 0, -1).reshape(n_out, 16)  # op i = 4 block + j is word j of block i // 4
    u = ((words >> np.uint64(8)).astype(np.float64) + 0.5) * 2.0**-24
    return -np.log(-np.log(u))


def _wires(n_in, a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    if n_in < 1:
        raise ValueError(f"difflogic reference: n_in = {n_in}, expected >= 1")
    if a.ndim != 1 or b.shape != a.shape:
        raise ValueError(f"difflogic reference: a, b must be two (n_out,) vectors, got {a.shape} and {b.shape}")
    for name, w in (("a", a), ("b", b)):
        bad = np.flatnonzero((w < 0) | (w >= n_in))
        if bad.size:
            g = int(bad[0])
            raise ValueError(f"difflogic reference: {name}[{g}] = {int(w[g])} is outside [0, {n_in})")
    return a.astype(np.int64), b.astype(np.int64)


def _logits(logits, n_out):
    logits = np.asarray(logits, dtype=np.float64)
    if logits.shape != (n_out, N_OPS):
        raise ValueError(f"difflogic reference: logits must be ({n_out}, 16), got {logits.shape}")
    return logits


def softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def hard_ops(logits):
    """The argmax per gate; np.argmax returns the first maximum: ties go to the lower index."""
    return np.argmax(np.asarray(logits, dtype=np.float64), axis=-1)


def tables(logits, hard=False):
    """T (n_out, 4) = p . truth table."""
    logits = np.asarray(logits, dtype=np.float64)
    p = np.eye(N_OPS)[hard_ops(logits)] if hard else softmax(logits)
    return p @ TRUTH


def _gate(t, xa, xb):
    return t[:, 0] * (1 - xa) * (1 - xb) + t[:, 1] * (1 - xa) * xb + t[:, 2] * xa * (1 - xb) + t[:, 3] * xa * xb


def consumers(n_in, a, b):
    """(offsets (n_in + 1,), entries (2 n_out,)): input j's readers 2 g + side, ascending."""
    a, b = _wires(n_in, a, b)
    reader = np.stack([a, b], axis=1).ravel()  # reader[2 g + side] = the input it reads
    entries = np.argsort(reader, kind="stable")  # stable: ascending 2 g + side within each input
    offsets = np.concatenate([[0], np.cumsum(np.bincount(reader, minlength=n_in))])
    return offsets.astype(np.int64), entries.astype(np.int64)


def layer_fwd(x, logits, a, b, hard=False):
    """y (B, n_out); the straight-through estimator's forward is hard=True."""
    x = np.asarray(x, dtype=np.float64)
    a, b = _wires(x.shape[1], a, b)
    t = tables(_logits(logits, a.size), hard)
    return _gate(t, x[:, a], x[:, b])


def layer_bwd(dout, x, logits, a, b, grad_factor=1.0):
    """(dx (B, n_in), dlogits (n_out, 16)): the soft layer's gradients of sum(dout * y)."""
    x = np.asarray(x, dtype=np.float64)
    dout = np.asarray(dout, dtype=np.float64)
    B, n_in = x.shape
    a, b = _wires(n_in, a, b)
    logits = _logits(logits, a.size)
    if dout.shape != (B, a.size):
        raise ValueError(f"difflogic reference: dout must be ({B}, {a.size}), got {dout.shape}")
    p = softmax(logits)
    t = p @ TRUTH
    xa, xb = x[:, a], x[:, b]
    y = _gate(t, xa, xb)
    ops = np.stack([op(xa, xb) for op in OPS], axis=-1)  # (B, n_out, 16)
    dlogits = np.einsum("sg,gi,sgi->gi", dout, p, ops - y[..., None])
    da = dout * ((t[:, 2] - t[:, 0]) * (1 - xb) + (t[:, 3] - t[:, 1]) * xb)
    db = dout * ((t[:, 1] - t[:, 0]) * (1 - xa) + (t[:, 3] - t[:, 2]) * xa)
    dside = np.stack([da, db], axis=-1).reshape(B, -1)  # dside[:, 2 g + side]
    offsets, entries = consumers(n_in, a, b)
    dx = np.zeros((B, n_in))
    for j in range(n_in):  # each input sums its readers in the CSR's order
        acc = np.zeros(B)
        for e in entries[offsets[j]:offsets[j + 1]]:
            acc = acc + dside[:, e]
        dx[:, j] = grad_factor * acc
    return dx, dlogits


def _groups(n, k):
    if k < 1 or n % k:
        raise ValueError(f"difflogic reference: k = {k} must be >= 1 and divide n = {n}")
    return n // k


def group_sum(x, k, tau=1.0):
    x = np.asarray(x, dtype=np.float64)
    m = _groups(x.shape[1], k)
    return x.reshape(x.shape[0], k, m).sum(axis=-1) / tau


def group_sum_bwd(dy, n, tau=1.0):
    dy = np.asarray(dy, dtype=np.float64)
    m = _groups(n, dy.shape[1])
    return np.repeat(dy, m, axis=1) / tau


def _width(w):
    if w not in (32, 64):
        raise ValueError(f"difflogic reference: w = {w}, expected 32 or 64")


def binarize(x):
    """What difflogic.pack packs: 1 where x > 0.5, else 0 (NaN: 0); {0, 1} pass unchanged."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return (x > 0.5).astype(np.float64)


def pack(x, w):
    """{0,1} (B, n) -> uint64 words (n, ceil(B / w)); a 32-bit word in the low half."""
    _width(w)
    x = np.asarray(x, dtype=np.float64)
    if not np.all((x == 0) | (x == 1)):
        raise ValueError("difflogic reference: x must hold only 0 and 1")
    B, n = x.shape
    W = -(-B // w)
    bits = np.zeros((n, W * w), dtype=np.uint64)
    bits[:, :B] = x.T.astype(np.uint64)
    shifts = np.arange(w, dtype=np.uint64)
    return np.bitwise_or.reduce(bits.reshape(n, W, w) << shifts, axis=-1)


def unpack(words, B, w):
    _width(w)
    words = np.asarray(words, dtype=np.uint64)
    s = np.arange(B)
    bits = (words[:, s // w] >> (s % w).astype(np.uint64)) & np.uint64(1)
    return bits.T.astype(np.float64)


def packed_fwd(words, B, w, ops, a, b):
    _width(w)
    words = np.asarray(words, dtype=np.uint64)
    a, b = _wires(words.shape[0], a, b)
    ops = np.asarray(ops, dtype=np.int64)
    ones = np.uint64(2**w - 1)
    f = np.where(TRUTH[ops] > 0, ones, np.uint64(0))[:, :, None]  # (n_out, 4, 1)
    A, Bw = words[a], words[b]
    r = (f[:, 0] & ~A & ~Bw) | (f[:, 1] & ~A & Bw) | (f[:, 2] & A & ~Bw) | (f[:, 3] & A & Bw)
    valid = np.clip(B - np.arange(words.shape[1]) * w, 0, w)
    mask = np.array([2**int(v) - 1 for v in valid], dtype=np.uint64)
    return r & mask & ones


def packed_group_sum(words, B, w, k):
    """counts (B, k) int64."""
    bits = unpack(words, B, w)
    m = _groups(bits.shape[1], k)
    return bits.reshape(B, k, m).sum(axis=-1).astype(np.int64)


# ---- DiffLogic cellular automaton (the twin of difflogic_ca_step_ref / _bwd_ref) ----
# state (B, H, W, C). For every channel c, the 3x3 patch of channel c around a cell (index 3 (dy+1) + (dx+1),
# centre 4; outside the grid 0, or wrapped when periodic) runs through K perception kernels: first layer
# 8 gates, gate g reading (patch[perm[g]], patch[4]); further layers wired by `perception` [(a, b), ...],
# shared by the kernels; logits per kernel: perception_logits[l] (K, width, 16). Output bit `bit` of
# kernel k for channel c lands at c P K + bit K + k of the perception. The update network (wires `update`,
# logits update_logits[l] (width, 16)) runs on [state | perception]; its C outputs replace the state
# where fire (B, H, W) is 1 (None: everywhere).

def _patches(state, periodic):
    B, H, W, C = state.shape
    padded = np.pad(state, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="wrap" if periodic else "constant")
    cols = [padded[:, dy:dy + H, dx:dx + W, :] for dy in range(3) for dx in range(3)]  # 9 x (B, H, W, C)
    return np.stack(cols, axis=-1).reshape(B * H * W * C, 9)


def _perception_wires(perm, perception, l):
    return (np.asarray(perm), np.full(8, 4)) if l == 0 else perception[l - 1]


def _ca_forward(state, perm, perception, update, perception_logits, update_logits, periodic, hard):
    state = np.asarray(state, dtype=np.float64)
    B, H, W, C = state.shape
    K = np.asarray(perception_logits[0]).shape[0]
    patches = _patches(state, periodic)
    saved_p = []
    outs = []
    for k in range(K):
        x, ins = patches, []
        for l in range(len(perception_logits)):
            a, b = _perception_wires(perm, perception, l)
            ins.append(x)
            x = layer_fwd(x, np.asarray(perception_logits[l])[k], a, b, hard)
        saved_p.append(ins)
        outs.append(x)  # (N C, P)
    P = outs[0].shape[1]
    perc = np.stack(outs, axis=-1).reshape(B * H * W, C * P * K)  # (cell, c, bit, k)
    u = np.concatenate([state.reshape(B * H * W, C), perc], axis=1)
    saved_u = []
    for (a, b), lg in zip(update, update_logits):
        saved_u.append(u)
        u = layer_fwd(u, lg, a, b, hard)
    return u, saved_p, saved_u, P, K


def ca_step(state, perm, perception, update, perception_logits, update_logits, periodic=False, fire=None,
            hard=False):
    """The new state (B, H, W, C)."""
    state = np.asarray(state, dtype=np.float64)
    out = _ca_forward(state, perm, perception, update, perception_logits, update_logits, periodic, hard)[0]
    out = out.reshape(state.shape)
    if fire is not None:
        out = np.where(np.asarray(fire)[..., None] == 0, state, out)
    return out


def ca_step_bwd(dnew, state, perm, perception, update, perception_logits, update_logits, periodic=False,
                fire=None):
    """(dstate, [dperception_logits], [dupdate_logits]) of sum(dnew * ca_step(...)), the soft step."""
    state = np.asarray(state, dtype=np.float64)
    B, H, W, C = state.shape
    N = B * H * W
    _, saved_p, saved_u, P, K = _ca_forward(state, perm, perception, update, perception_logits, update_logits,
                                            periodic, False)
    d = np.asarray(dnew, dtype=np.float64).reshape(N, C)
    dstate = np.zeros((N, C))
    if fire is not None:
        keep = (np.asarray(fire).reshape(N) == 0)[:, None]
        dstate = np.where(keep, d, 0.0)
        d = np.where(keep, 0.0, d)
    dupdate = [None] * len(update)
    for l in reversed(range(len(update))):
        a, b = update[l]
        d, dupdate[l] = layer_bwd(d, saved_u[l], update_logits[l], a, b)
    dstate += d[:, :C]
    dperc = d[:, C:].reshape(N, C, P, K)
    dpatches = np.zeros((N * C, 9))
    dperception = [np.zeros_like(np.asarray(lg, dtype=np.float64)) for lg in perception_logits]
    for k in range(K):
        dk = dperc[..., k].reshape(N * C, P)
        for l in reversed(range(len(perception_logits))):
            a, b = _perception_wires(perm, perception, l)
            dk, dperception[l][k] = layer_bwd(dk, saved_p[k][l], np.asarray(perception_logits[l])[k], a, b)
        dpatches += dk
    # Each patch value is a neighbour's state: scatter its gradient back (the zero padding takes none).
    dpad = np.zeros((B, H + 2, W + 2, C))
    dp = dpatches.reshape(B, H, W, C, 9)
    for q in range(9):
        dy, dx = divmod(q, 3)
        dpad[:, dy:dy + H, dx:dx + W, :] += dp[..., q]
    if periodic:
        dpad[:, 1:2, :, :] += dpad[:, H + 1:H + 2, :, :]
        dpad[:, H:H + 1, :, :] += dpad[:, 0:1, :, :]
        dpad[:, :, 1:2, :] += dpad[:, :, W + 1:W + 2, :]
        dpad[:, :, W:W + 1, :] += dpad[:, :, 0:1, :]
    dstate = dstate.reshape(B, H, W, C) + dpad[:, 1:H + 1, 1:W + 1, :]
    return dstate, dperception, dupdate
