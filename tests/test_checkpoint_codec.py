"""The 8-bit codec on whole tensors that checkpoints use (``ops.encode_8bit``/``decode_8bit``: the
host kernel, csrc/cpu/codec_cpu.cpp) gives the PyTorch codec's bits (fusedoff/kernels/codec.py, the
mirror of csrc/include/fusedoff/state_codec.h that the torch backend steps with), for every code and
for values across the whole fp32 range, special values included."""

from __future__ import annotations

import pytest
import torch

from fusedoff import _ext, ops
from fusedoff.kernels import codec
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not _ext.native_available(), reason="the native extension is not built")

SIZES = (1, 7, codec.QUANT_BLOCK - 1, codec.QUANT_BLOCK, codec.QUANT_BLOCK + 1, 4097, 100_003)


def values(n: int, signed: bool, seed: int) -> torch.Tensor:
    """Magnitudes over the fp32 range (a log-normal spread of 2^+-40 around 1, blocks of very different
    scales), zeros, and, where there is room, NaN, +-inf, a subnormal, -0.0 (and negative second moments,
    which encode as NaN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randn(n, generator=g) * 13)
    x[::17] = 0.0
    if n > 16:
        x[3], x[5], x[6], x[8], x[9] = float("nan"), float("inf"), -float("inf"), 1e-40, -0.0
    if not signed:
        x = x.abs()
        if n > 16:
            x[2], x[10] = -1.0, -0.0
    return x


@pytest.mark.parametrize("signed", (True, False), ids=("signed", "unsigned"))
@pytest.mark.parametrize("n", SIZES)
def test_the_host_codec_gives_the_pytorch_codecs_codes_scales_and_values(n, signed):
    x = values(n, signed, seed=n)
    codes, absmax = ops.encode_8bit(x, signed)
    want_codes, want_absmax = codec.quantize(x, signed=signed)
    assert torch.equal(codes, want_codes)
    assert_bitwise_equal(absmax, want_absmax)
    # every code under every block's scale, the scales of the values above
    every_code = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    assert_bitwise_equal(ops.decode_8bit(every_code, absmax, signed),
                         codec.dequantize(every_code, absmax, signed=signed))


def test_the_host_codec_refuses_what_it_cannot_read_with_a_clear_error():
    with pytest.raises(RuntimeError, match="values must be float32"):
        torch.ops.fusedoff.encode_8bit(torch.zeros(4, dtype=torch.float64), True)
    with pytest.raises(RuntimeError, match="flat and contiguous"):
        torch.ops.fusedoff.encode_8bit(torch.zeros(4, 4), True)
    with pytest.raises(RuntimeError, match="300 codes need 2 block scales, got 1"):
        torch.ops.fusedoff.decode_8bit(torch.zeros(300, dtype=torch.uint8), torch.ones(1), True)
