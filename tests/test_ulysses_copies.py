"""The Ulysses exchange's layout copies on 8-byte words (vdbench.patching.ulysses.copy_wide): the bytes of a plain
``copy_``, bit for bit, whatever the values; ``copy_`` itself where the rows are not whole words."""

import torch

from vdbench.patching.ulysses import copy_wide


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_a_permuting_copy_on_words_moves_the_same_bits():
    g = torch.Generator().manual_seed(0)
    p, b, s, hd = 2, 1, 37, 24  # (P, B, S_loc, h * D): the output exchange's receive buffer
    recv = torch.randn(p, b, s, hd, generator=g).to(torch.bfloat16)
    recv.view(torch.int16)[0, 0, 0, :4] = torch.tensor([0x7FC1, -1, 0x0001, -0x8000], dtype=torch.int16)  # NaN, -NaN
    out = torch.empty(b, s, p * hd, dtype=torch.bfloat16)
    copy_wide(out.view(b, s, p, hd), recv.permute(1, 2, 0, 3))
    want = recv.permute(1, 2, 0, 3).reshape(b, s, p * hd)
    assert torch.equal(_bits(out), _bits(want))


def test_rows_that_are_not_whole_words_take_copy():
    src = torch.randn(5, 3, dtype=torch.float32).to(torch.bfloat16).t()  # last dim not contiguous
    dst = torch.empty(3, 5, dtype=torch.bfloat16)
    assert torch.equal(copy_wide(dst, src), src)
    odd = torch.randn(4, 3).to(torch.bfloat16)  # 3 bf16 = 6 bytes a row
    assert torch.equal(copy_wide(torch.empty(4, 3, dtype=torch.bfloat16), odd), odd)
    wide = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(copy_wide(torch.empty(4, 6, dtype=torch.float64), wide), wide)
    mixed = torch.randn(4, 8)  # fp32 into bf16: a conversion, not a byte copy
    assert torch.equal(copy_wide(torch.empty(4, 8, dtype=torch.bfloat16), mixed), mixed.to(torch.bfloat16))
