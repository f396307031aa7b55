"""The split of a large embedding batch across holders (router.split), from the plan's estimates."""

from __future__ import annotations

import pytest

from router.split import Reader, finish_together, split_sizes

TEN = [10] * 20  # twenty inputs of ten tokens: 200 tokens


def test_two_equal_idle_holders_take_half_the_batch_each() -> None:
    readers = [
        Reader(worker="a", start_s=0.0, rate_tps=100.0),
        Reader(worker="b", start_s=0.0, rate_tps=100.0),
    ]
    assert split_sizes(readers, TEN) == [("a", 10), ("b", 10)]
    assert finish_together(readers, 200.0) == pytest.approx(1.0)


def test_a_holder_three_times_faster_takes_three_quarters() -> None:
    readers = [
        Reader(worker="fast", start_s=0.0, rate_tps=300.0),
        Reader(worker="slow", start_s=0.0, rate_tps=100.0),
    ]
    assert split_sizes(readers, TEN) == [("fast", 15), ("slow", 5)]


def test_a_busy_holder_gets_only_what_it_can_read_after_it_frees() -> None:
    # b frees at 0.5 s; together they finish at 1.25 s: a reads 125 tokens, b 75.
    readers = [
        Reader(worker="a", start_s=0.0, rate_tps=100.0),
        Reader(worker="b", start_s=0.5, rate_tps=100.0),
    ]
    assert finish_together(readers, 200.0) == pytest.approx(1.25)
    assert split_sizes(readers, TEN) == [("a", 12), ("b", 8)]


def test_a_holder_that_frees_after_the_batch_would_be_done_gets_nothing() -> None:
    readers = [
        Reader(worker="a", start_s=0.0, rate_tps=100.0),
        Reader(worker="b", start_s=5.0, rate_tps=100.0),
    ]
    assert split_sizes(readers, TEN) == [("a", 20)]


def test_a_small_batch_or_a_marginal_gain_is_not_split() -> None:
    equal = [Reader(worker="a", start_s=0.0, rate_tps=100.0), Reader(worker="b", start_s=0.0, rate_tps=100.0)]
    assert split_sizes(equal, [10] * 4) == [("a", 4)]
    # The slow holder would save 1/11 of the time: under the 20 % a split must save.
    lopsided = [
        Reader(worker="a", start_s=0.0, rate_tps=1000.0),
        Reader(worker="b", start_s=0.0, rate_tps=100.0),
    ]
    assert split_sizes(lopsided, TEN) == [("a", 20)]


def test_the_parts_cover_every_input_in_order_whatever_the_sizes() -> None:
    tokens = [1, 50, 3, 200, 7, 7, 7, 90, 1, 1, 400, 2]
    readers = [
        Reader(worker="a", start_s=0.0, rate_tps=100.0),
        Reader(worker="b", start_s=0.2, rate_tps=80.0),
        Reader(worker="c", start_s=0.1, rate_tps=60.0),
    ]
    parts = split_sizes(readers, tokens)
    assert sum(n for _, n in parts) == len(tokens)
    assert all(n > 0 for _, n in parts)
