"""A step's input tensors (services/engine/step_inputs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nibble.services.engine.step_inputs import padded_block_tables, positions_of


def _seq(table, start=0, n=1):
    return SimpleNamespace(block_table=table, start_pos=start, token_ids=[1] * n)


def test_block_tables_are_int32_rows_padded_with_page_zero():
    got = padded_block_tables([_seq([7, 3, 9]), _seq([]), _seq([2**31 - 1])])
    assert got.dtype == torch.int32 and got.shape == (3, 3)
    assert got.tolist() == [[7, 3, 9], [0, 0, 0], [2**31 - 1, 0, 0]]


def test_long_block_tables_keep_every_page_in_order():
    tables = [list(range(i * 5000, i * 5000 + 2048 + i)) for i in range(4)]
    got = padded_block_tables([_seq(t) for t in tables])
    for row, t in zip(got.tolist(), tables):
        assert row[:len(t)] == t and not any(row[len(t):])


def test_positions_and_rows_follow_the_token_stream():
    pos, rows = positions_of([_seq([1], start=4, n=2), _seq([2], start=0, n=3)])
    assert pos.tolist() == [4, 5, 0, 1, 2] and rows.tolist() == [0, 0, 1, 1, 1]
