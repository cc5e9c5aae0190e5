"""The padded-rows copy (056's attention probabilities at a sequence length that is not a
multiple of 8): every element equal to the source, the padding up to the next 8 zero, argument
errors."""
import pytest
import torch

from cutebwd.kernels.padded_rows import copy_padded_rows


def test_dtype_error_names_the_tensor():
    with pytest.raises(TypeError, match="^src: expected dtype bfloat16"):
        copy_padded_rows(torch.zeros(4, 13), torch.zeros(4, 13, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,stride", [((2, 3, 37, 37), 40), ((613, 613), 616), ((5, 1), 8), ((3, 16), 16),
                                          ((4, 13), 48), ((7, 4097), 4104)])
def test_copies_every_row_and_zeroes_the_padding(shape, stride):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    src = torch.randn(shape, device="cuda", generator=g).bfloat16()
    rows, width = src.numel() // shape[-1], shape[-1]
    buffer = torch.full((rows, stride), float("nan"), dtype=torch.bfloat16, device="cuda")
    dst = buffer[:, :width].view(shape)
    assert copy_padded_rows(src, dst) is dst
    assert torch.equal(dst, src)
    rounded = -(-width // 8) * 8
    assert not buffer[:, width:rounded].any()  # zeros (NaN would count as nonzero)
    assert buffer[:, rounded:].isnan().all()  # past the 16-byte piece: untouched


@pytest.mark.gpu
def test_layout_errors_name_the_tensor():
    src = torch.zeros(4, 13, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^dst: rows 16-byte aligned"):
        copy_padded_rows(src, torch.zeros(4, 13, dtype=torch.bfloat16, device="cuda"))  # stride 13
    with pytest.raises(ValueError, match="^dst: rows 16-byte aligned"):
        copy_padded_rows(src, torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda")[:, :13].t().contiguous().t())
    with pytest.raises(ValueError, match="^dst: expected shape"):
        copy_padded_rows(src, torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="^src, dst: the leading dimensions"):
        copy_padded_rows(torch.zeros(2, 3, 13, dtype=torch.bfloat16, device="cuda").transpose(0, 1),
                         torch.zeros(3, 2, 16, dtype=torch.bfloat16, device="cuda")[..., :13])
