"""kspec.ops.linear's layout decision (pure Python, no GPU): which views of F.linear's arguments the gemm op
reads in place (gemm/layout.h's rule) and which linear copies first (issue 33: x[:, ::2] was refused).
The GPU test test_gpu_gemm.py::test_the_layout_rule_is_the_gemm_ops checks the rule against the op itself."""
import pytest

from kspec.ops import gemm_reads_in_place, linear_copies

M, K = 7, 33


@pytest.mark.parametrize("shape,strides,readable", [
    ((M, K), (K, 1), True),                      # contiguous
    ((M, K), (1, M), True),                      # transposed (column-major)
    ((M, K), (K + 5, 1), True),                  # sliced leading dim
    ((M, K), (2 * K, 2), False),                 # x[:, ::2]: no unit-stride dim
    ((M, K), (0, 1), False),                     # a broadcast row
    ((M, K), (1, M - 1), False),                 # column-major with a leading dim below the rows
    ((1, K), (5, 1), True),                      # one row: any row stride
    ((M, 1), (3, 7), True),                      # one column: any strides
    ((3, M, K), (0, K, 1), True),                # expanded batch
    ((3, M, K), (K, 3 * K, 1), True),            # (m, 3, k).transpose(0, 1)
    ((3, 2, M, K), (M * K, 3 * M * K, K, 1), False),  # two batch dims with no single stride
    ((2, 1, 3, M, K), (3 * M * K, 99, M * K, K, 1), True),  # a size-1 batch dim has any stride
    ((0, K), (K, 1), True),                      # no rows
    ((K,), (1,), True), ((K,), (2,), False),     # a bias
])
def test_reads_in_place(shape, strides, readable):
    assert gemm_reads_in_place(shape, strides) is readable


class _View:
    def __init__(self, shape, strides):
        self.shape, self._strides = shape, strides

    def stride(self):
        return self._strides


def test_linear_copies_names_each_operand_it_copies():
    x, w, b = _View((M, 2 * K), (4 * K, 2)), _View((24, 2 * K), (2 * K, 1)), _View((24,), (2,))
    assert [c[0] for c in linear_copies(x, w, b)] == ["x", "bias"]
    assert linear_copies(_View((K,), (3,)), w, None) == []  # a 1-d x is one row: any stride reads in place
    assert linear_copies(_View((M, K), (0, 1)), w, None) == [("x", (M, K), (0, 1))]
