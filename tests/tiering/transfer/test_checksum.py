"""checksum.chunk_sums (float64 product on the CPU) equals the int64 definition exactly,
at the largest sums too."""

import torch

from nibble.tiering.transfer import checksum as cs


def test_chunk_sums_equal_the_int64_reference_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    pages = torch.randint(0, 256, (4, 2 * cs.CHUNK + 77), dtype=torch.uint8, generator=g)
    pages[0] = 255                                  # the largest sum a chunk can have
    pages[1, :cs.CHUNK] = 0
    got, want = cs.chunk_sums(pages), cs.chunk_sums_ref(pages)
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape == (4, 3)
    assert torch.equal(got, want)
    assert int(want[0, 0]) == 255 * int(cs._mults(torch.device("cpu")).sum())
