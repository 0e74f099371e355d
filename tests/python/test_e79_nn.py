"""kspec.nn's E79 modules without a GPU: the reference model's state dicts load with strict=True in
every bias mode (and back), the constructor flags of the reference map to the bias modes, and on CPU
tensors the modules run the torch loop with the same results as the reference modules."""
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec.reference.e79_torch import E79CoupledMatrix as RefLayer  # noqa: E402
from kspec.reference.e79_torch import E79CoupledMatrixCell as RefCell  # noqa: E402

BIAS = ["none", "fixed", "input"]


def _flags(bias):
    return dict(use_bias=bias != "none", input_bias=bias == "input")


@pytest.mark.parametrize("bias", BIAS)
def test_cell_state_dict_round_trip_strict(bias):
    ref = RefCell(24, n_state=8, **_flags(bias))
    cell = kspec.nn.E79Cell(24, 8, bias=bias)
    assert set(cell.state_dict()) == set(ref.state_dict())
    cell.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(cell.state_dict(), strict=True)
    expected = {"none": {"W_kvqm"}, "fixed": {"W_kvqm", "b_s_gate", "b_m_gate"},
                "input": {"W_kvqm", "W_bs", "W_bm"}}[bias]
    assert {k for k, _ in cell.named_parameters()} == expected
    if bias != "fixed":
        assert {k for k, _ in cell.named_buffers()} == {"b_s_gate", "b_m_gate"}
        assert not cell.b_s_gate.any()


@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("use_conv", [False, True])
def test_layer_state_dict_strict_and_cpu_forward_matches(bias, use_conv):
    torch.manual_seed(0)
    ref = RefLayer(16, expansion=1.5, n_state=8, use_conv=use_conv, **_flags(bias))
    layer = kspec.nn.E79CoupledMatrix(16, expansion=1.5, n_state=8, use_conv=use_conv, bias=bias)
    layer.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 5, 16)
    y, (S, M) = layer(x)
    y_r, (S_r, M_r) = ref(x)
    assert y.shape == (2, 5, 16) and S.shape == (2, 8, 8)
    torch.testing.assert_close(y, y_r)
    torch.testing.assert_close(S, S_r)
    torch.testing.assert_close(M, M_r)


def test_reference_flags_map_to_bias_modes():
    assert kspec.nn.E79Cell(8, 8, use_bias=False).bias_mode == "none"
    assert kspec.nn.E79Cell(8, 8, input_bias=True).bias_mode == "input"
    assert kspec.nn.E79Cell(8, 8).bias_mode == "fixed"
    with pytest.raises(ValueError, match="bias must be one of"):
        kspec.nn.E79Cell(8, 8, bias="learned")
    with pytest.raises(ValueError, match="contradicts"):
        kspec.nn.E79Cell(8, 8, bias="none", input_bias=True)


def test_cpu_cell_matches_float64_reference():
    import numpy as np
    from kspec.reference import e79 as ref64

    torch.manual_seed(1)
    cell = kspec.nn.E79Cell(12, 8, bias="input").double()
    x = torch.randn(6, 3, 12, dtype=torch.float64)
    out, S, M = cell(x)
    W = torch.cat([cell.W_kvqm, cell.W_bs, cell.W_bm]).detach().numpy()
    proj = x.numpy() @ W.T
    k, v, q, m, bs, bm = (proj[..., j * 8:(j + 1) * 8] for j in range(6))
    out_r, S_r, M_r = ref64.e79_fwd(k, v, q, m, bs, bm)
    # the torch loop runs in fp32 whatever the module's dtype
    assert np.abs(out.detach().numpy() - out_r).max() <= 1e-4 * max(1.0, np.abs(out_r).max())
    assert np.abs(S.detach().numpy() - S_r).max() <= 1e-4 * max(1.0, np.abs(S_r).max())
