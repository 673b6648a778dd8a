"""The RMSNorm launch constants (videosft.kernels.norms): few compiled kernels over every length, and a
backward split that still covers every row with most of the GPU's SMs."""

from __future__ import annotations

import math

from videosft.kernels.norms import backward_split, forward_blocks, rounded_up

SMS = 132  # an H100 / H200


def test_rounded_up_is_the_next_power_of_two_or_one_and_a_half_times_one():
    assert [rounded_up(v) for v in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    for value in range(1, 5000):
        step = rounded_up(value)
        assert value <= step < 1.5 * value + 1  # never more than half as much again
        assert step & (step - 1) == 0 or (step // 3) & (step // 3 - 1) == 0 and step % 3 == 0


def test_every_length_up_to_a_long_pack_compiles_few_kernels():
    # rows: the hidden-state norm's tokens and the head norms' tokens x heads, for packs up to 32k tokens
    lengths = range(1, 32768 * 16 + 1, 7)
    splits = {backward_split(rows, SMS)[0] for rows in lengths}
    blocks = {forward_blocks(rows) for rows in lengths}
    # fla's own constants: one kernel per distinct cdiv(rows, SMs) and per cdiv(rows, 2048)
    assert len({math.ceil(rows / min(SMS, rows)) for rows in lengths}) > 3900
    assert len(splits) <= 2 * math.log2(32768 * 16) and len(blocks) <= 2 * math.log2(32768 * 16 / 2048) + 2


def test_the_backward_split_covers_every_row_once_with_two_thirds_of_fla_s_programs_or_more():
    for rows in list(range(1, 3000)) + [5079, 13386, 16384 * 16, 100_003]:
        per_program, programs = backward_split(rows, SMS)
        assert (programs - 1) * per_program < rows <= programs * per_program  # no program without rows
        assert programs <= SMS
        fla_rows_per_program = math.ceil(rows / min(SMS, rows))
        fla_programs_with_rows = math.ceil(rows / fla_rows_per_program)
        assert programs >= 2 * fla_programs_with_rows / 3, (rows, per_program, programs)

