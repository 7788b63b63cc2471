"""The claim board of ``steal_batches``: a rank a whole clock behind loses
its part of the clock to the ranks that are on time, each part gets exactly
one set of owners whatever order the claims come in, and bad claims are
refused."""

from __future__ import annotations

import random

import pytest

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune.session._steal import ClaimBoard, check_owners


def test_ranks_in_step_keep_their_parts() -> None:
    board = ClaimBoard(2)
    for clock in range(5):
        assert board.claim(0, 1, clock) == [[0], [1]]
        assert board.claim(1, 1, clock) == [[0], [1]]


def test_a_rank_a_clock_behind_loses_its_part_and_gets_the_same_answer_later() -> None:
    board = ClaimBoard(2)
    board.claim(0, 1, 0)
    board.claim(1, 1, 0)
    assert board.claim(0, 1, 1) == [[0], [1]]  # rank 1 is within the clock: not late
    assert board.claim(0, 1, 2) == [[0], [0]]  # rank 1 has not started clock 1: late
    assert board.claim(0, 1, 3) == [[0], [0]]
    assert board.claim(1, 1, 1) == [[0], [1]]  # clock 1 was decided before it fell behind
    assert board.claim(1, 1, 2) == [[0], [0]]  # the decision of clock 2 stands: rank 1 computes nothing
    assert board.claim(1, 1, 3) == [[0], [0]]
    assert board.claim(1, 1, 4) == [[0], [1]]  # rank 1 is first at clock 4: rank 0 claimed 3
    assert board.claim(0, 1, 4) == [[0], [1]]


def test_a_late_part_is_split_among_the_ranks_on_time_and_a_new_run_starts_afresh() -> None:
    board = ClaimBoard(4)
    for rank in range(4):
        board.claim(rank, 7, 0)
    for rank in (0, 2, 3):
        board.claim(rank, 7, 1)
    assert board.claim(2, 7, 2) == [[0], [0, 2, 3], [2], [3]]
    assert board.claim(0, 8, 0) == [[0], [1], [2], [3]]  # a new run: nobody is behind yet
    with pytest.raises(InvalidArgumentError, match="run 7, which ended"):
        board.claim(1, 7, 1)


def test_any_order_of_claims_gives_every_part_one_set_of_owners() -> None:
    rng = random.Random(3)
    for _ in range(50):
        world, clocks = rng.randint(2, 5), 12
        board = ClaimBoard(world)
        next_clock = [0] * world
        seen: dict[int, list[list[int]]] = {}
        while min(next_clock) < clocks:
            rank = rng.choice([r for r in range(world) if next_clock[r] < clocks])
            owners = board.claim(rank, 0, next_clock[rank])
            assert seen.setdefault(next_clock[rank], owners) == owners
            for part, who in enumerate(owners):
                assert who == [part] or part not in who and who == sorted(who) and who
            next_clock[rank] += 1


def test_bad_claims_are_refused() -> None:
    board = ClaimBoard(2)
    with pytest.raises(InvalidArgumentError, match="its next is 0"):
        board.claim(0, 0, 1)
    board.claim(0, 0, 0)
    with pytest.raises(InvalidArgumentError, match="its next is 1"):
        board.claim(0, 0, 0)
    for value in (None, {"run": 0}, {"run": -1, "clock": 0}, {"run": 0, "clock": True}, [0, 1]):
        with pytest.raises(InvalidArgumentError, match="non-negative integers"):
            board.answer(1, value)
    with pytest.raises(InvalidArgumentError, match="outside 0..1"):
        board.answer(2, {"run": 0, "clock": 0})
    assert board.answer(1, {"run": 0, "clock": 0}) == [[0], [1]]


def test_a_malformed_answer_is_refused() -> None:
    assert check_owners([[0], [0, 1]], 2) == [[0], [0, 1]]
    for owners in ([[0]], [[0], []], [[0], [2]], [[0], [1, 1]], [[0], "1"], None, [[0], [True]]):
        with pytest.raises(InvalidArgumentError, match="answered a batch claim"):
            check_owners(owners, 2)
