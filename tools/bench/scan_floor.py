"""The floor under a selective_scan training step through torch's autograd: an autograd.Function of the scan's 8
inputs (u, delta, A, B, C, D, z, delta_bias) that allocates out like u and the 8 gradients in the backward
(AccumulateGrad takes them as they are: no copy) and launches nothing. mamba_ssm's step is such a Function with
kernels; kspec's node is the extension's C++ one, so kspec may be below it. Used by selective_scan.py's fwd+bwd
rows and tools/gpu/profile_scan_host.py's --probe (which imports it with this folder on sys.path, as
profile_mlstm.py does timing.py); torch is imported at the first apply (the bench imports its families without
it)."""


class NoopScan:
    _fn = None

    @classmethod
    def apply(cls, *args):
        if cls._fn is None:
            import torch

            class NoopScan(torch.autograd.Function):
                @staticmethod
                def forward(ctx, u, delta, A, B, C, D, z, delta_bias):
                    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias)
                    return torch.empty_like(u)

                @staticmethod
                def backward(ctx, dout):
                    return tuple(torch.empty_like(t) for t in ctx.saved_tensors)
            cls._fn = NoopScan
        return cls._fn.apply(*args)
