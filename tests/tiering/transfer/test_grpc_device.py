"""The gRPC transport between two VRAM pools on one GPU (pinned staging on both sides)."""

import os

import pytest
import torch

from nibble.tiering.transfer import CompletedTransfer, TransferState, create_transport
from nibble.tiering.transfer import page_set_checksum

pytestmark = pytest.mark.gpu
SECRET = os.urandom(32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("src, dst", [(list(range(8)), list(range(10, 18))),
                                      ([7, 1, 2, 3, 12], [0, 5, 6, 7, 3])])
def test_vram_pages_arrive_bit_identical_through_the_host(src, dst):
    g = torch.Generator().manual_seed(0)
    tx_pool = torch.randint(0, 256, (20, 3, 5000), dtype=torch.uint8, generator=g).cuda()
    rx_pool = torch.zeros_like(tx_pool)
    rx = create_transport("grpc", secret=SECRET)
    tx = create_transport("grpc", secret=SECRET, chunk_bytes=7000)   # chunks span pages
    try:
        rx.attach(rx_pool)
        tx.attach(tx_pool)
        ticket = rx.issue_ticket("r", dst, 30.0)
        status = tx.wait(tx.write_pages(rx.endpoint(), ticket, src))
        assert status.state == TransferState.SUCCESS, status.error
        [done] = rx.received()
        assert isinstance(done, CompletedTransfer)
        assert page_set_checksum(rx_pool, dst) == page_set_checksum(tx_pool, src)
        assert torch.equal(rx_pool[dst].cpu(), tx_pool[src].cpu())
        others = [p for p in range(20) if p not in dst]
        assert int(rx_pool[others].sum()) == 0
    finally:
        tx.close()
        rx.close()
