"""Sums over groups of heads (056's dk and dv): every piece equal to the fp32 sum rounded once,
written only where the head view points, argument errors."""
import pytest
import torch

from cutebwd.kernels.head_groups import sum_head_groups


def test_dtype_error_names_the_tensor():
    with pytest.raises(TypeError, match="^per_head: expected dtype bfloat16"):
        sum_head_groups(torch.zeros(1, 4, 3, 8), torch.zeros(1, 1, 3, 8, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,groups,seq,width", [(2, 32, 8, 13, 160), (1, 32, 8, 449, 160), (3, 4, 2, 5, 8),
                                                          (1, 6, 3, 1, 24), (2, 8, 8, 7, 16)])
def test_sums_each_group_into_the_head_view(batch, heads, groups, seq, width):
    g = torch.Generator(device="cuda").manual_seed(heads * seq + width)
    per_head = torch.randn(batch, heads, seq, width, device="cuda", generator=g).bfloat16()
    # the [b * s, groups * d] rows the layer writes, one spare column of pieces on each row
    rows = torch.full((batch * seq, groups * width + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    into = rows[:, :groups * width].view(batch, seq, groups, width).transpose(1, 2)
    assert sum_head_groups(per_head, into) is into
    want = per_head.float().view(batch, groups, heads // groups, seq, width).sum(2)
    torch.testing.assert_close(into.float(), want, rtol=2**-8, atol=0)  # one bf16 rounding of the fp32 sum
    assert (into == want.bfloat16()).float().mean() > 0.999  # the same rounding but for fp32 order ties
    assert rows[:, groups * width:].isnan().all()  # nothing past the view


@pytest.mark.gpu
def test_layout_errors_name_the_tensor():
    per_head = torch.zeros(1, 4, 3, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^into: expected"):
        sum_head_groups(per_head, torch.zeros(1, 3, 3, 16, dtype=torch.bfloat16, device="cuda"))  # 4 heads in 3 groups
    with pytest.raises(ValueError, match="^into: head width 12"):
        sum_head_groups(torch.zeros(1, 4, 3, 12, dtype=torch.bfloat16, device="cuda"),
                        torch.zeros(1, 2, 3, 12, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="^per_head: expected a contiguous tensor"):
        sum_head_groups(per_head.transpose(1, 2).contiguous().transpose(1, 2),
                        torch.zeros(1, 2, 3, 16, dtype=torch.bfloat16, device="cuda"))
