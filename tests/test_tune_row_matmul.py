"""The row_matmul tuner's sweep (what it tries) and record (how much each family lost).

The timing itself needs a GPU; which candidates exist and how results are summarised do not.
"""

from __future__ import annotations

import pytest

from bench.tune_row_matmul import best_by_kind, candidates, kind_of, parse_schedules


def test_operand_orders_double_the_sweep():
    plain = candidates(9216, 2560, (16, 64), ((4, 3),), (False,))
    both = candidates(9216, 2560, (16, 64), ((4, 3),), (False, True))
    assert len(both) == 2 * len(plain) and {c.swap_ab for c in both} == {False, True}


def test_schedules_multiply_the_sweep():
    one = candidates(4096, 2560, (64,))
    two = candidates(4096, 2560, (64,), parse_schedules("4x3,8x5"))
    assert len(two) == 2 * len(one)
    assert {(c.num_warps, c.num_stages) for c in two} == {(4, 3), (8, 5)}


@pytest.mark.parametrize("text", ["4", "4x", "x3", "3x3", "4y3", "4x0"])
def test_bad_schedules_are_refused(text):
    with pytest.raises(ValueError, match="WARPSxSTAGES"):
        parse_schedules(text)


def test_the_record_keeps_each_familys_fastest():
    sweep = candidates(4096, 2560, (16,), ((4, 3), (8, 3)), (False, True))
    scores = [(7 * i) % len(sweep) for i in range(len(sweep))]  # a shuffled ranking
    timed = [(float(scores[i]), 1.0 * i, 2.0 * i, c) for i, c in enumerate(sweep)]
    timed.sort(key=lambda r: r[0])  # best first, as the tuner sorts
    best = best_by_kind(timed)
    assert set(best) == {kind_of(c) for c in sweep} and len(best) == 4
    for kind, times in best.items():
        family = [i for i, c in enumerate(sweep) if kind_of(c) == kind]
        fastest = min(family, key=lambda i: scores[i])
        assert times == {"us_16_rows": 1.0 * fastest, "us_128_rows": 2.0 * fastest}
