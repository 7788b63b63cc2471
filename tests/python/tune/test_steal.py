"""The claim board of ``steal_batches``: a rank a whole clock behind loses
its part of the clock, and its unclaimed part of the clock before, to the
ranks that are on time; those clocks are declared empty once; every part
gets exactly one set of owners whatever order the claims come in; and bad
claims and answers are refused."""

from __future__ import annotations

import random

import pytest

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune.session._steal import Claim, ClaimBoard, ClaimsThroughRankZero, Wait


def test_ranks_in_step_keep_their_parts() -> None:
    board = ClaimBoard(2, late_after=0)
    for clock in range(5):
        for rank in (0, 1):
            assert board.claim(rank, 1, clock) == Claim([[0], [1]], {}, [])


def test_a_rank_a_clock_behind_loses_its_part_and_its_unclaimed_one_before() -> None:
    board = ClaimBoard(2, late_after=0)
    board.claim(0, 1, 0)
    board.claim(1, 1, 0)
    assert board.claim(0, 1, 1).owners == [[0], [1]]  # rank 1 is within the clock: not late
    # Rank 1 has not started clock 1: its parts of clocks 1 and 2 go to rank 0, in clock 2.
    assert board.claim(0, 1, 2) == Claim([[0], [0]], {1: [[], [0]]}, [(1, 1), (1, 2)])
    assert board.claim(0, 1, 3) == Claim([[0], [0]], {}, [(1, 3)])  # nothing left to carry
    late = board.claim(1, 1, 1)
    assert late == Claim([[0], []], {}, [])  # clock 1's part moved on: rank 1 computes nothing
    assert not late.computes(1)
    assert not board.claim(1, 1, 2).computes(1)
    assert not board.claim(1, 1, 3).computes(1)
    assert board.claim(1, 1, 4) == Claim([[0], [1]], {}, [])  # first at clock 4: rank 0 claimed 3
    assert board.claim(0, 1, 4).owners == [[0], [1]]


def test_late_parts_are_split_among_the_ranks_on_time_and_a_new_run_starts_afresh() -> None:
    board = ClaimBoard(4, late_after=0)
    for rank in range(4):
        board.claim(rank, 7, 0)
    for rank in (0, 2, 3):
        board.claim(rank, 7, 1)
    assert board.claim(2, 7, 2) == Claim([[0], [0, 2, 3], [2], [3]], {1: [[], [0, 2, 3], [], []]}, [(1, 1), (1, 2)])
    assert board.claim(0, 7, 2).declare == []  # only the claim that decided declares
    assert board.claim(0, 8, 0) == Claim([[0], [1], [2], [3]], {}, [])  # a new run
    with pytest.raises(InvalidArgumentError, match="run 7, which ended"):
        board.claim(1, 7, 1)


def test_a_late_rank_that_had_others_parts_keeps_its_clock() -> None:
    board = ClaimBoard(3, late_after=0)
    board.claim(0, 0, 0)
    board.claim(1, 0, 0)
    # Rank 2 has claimed nothing: its parts of clocks 0 and 1 go to ranks 0 and 1.
    assert board.claim(0, 0, 1) == Claim([[0], [1], [0, 1]], {0: [[], [], [0, 1]]}, [(2, 0), (2, 1)])
    # Rank 1 falls behind too, but its clock 1 holds a piece of rank 2's part: not carried on.
    assert board.claim(0, 0, 2) == Claim([[0], [0], [0]], {}, [(1, 2), (2, 2)])
    assert board.claim(1, 0, 1).computes(1)


@pytest.mark.parametrize("slack", [None, 1, 3])
def test_any_order_of_claims_computes_every_part_once(slack: int | None) -> None:
    """Ranks claim in random order; with a slack the board times lateness
    (claims a random time apart, rank 1 slower) and some claims wait."""
    rng = random.Random(3)
    waits = steals = 0
    for _ in range(60):
        world, clocks = rng.randint(2, 5), 12 if slack is None else 30
        now = _Clock()
        board = ClaimBoard(world, late_after=0) if slack is None else ClaimBoard(world, now=now)
        next_clock = [0] * world
        # (clock of the samples, rank whose part) -> the owners seen, and who claimed a piece of it
        owners_of: dict[tuple[int, int], list[int]] = {}
        computed: dict[tuple[int, int], set[int]] = {}
        declared: set[tuple[int, int]] = set()
        answers: dict[tuple[int, int], Claim] = {}
        while min(next_clock) < clocks:
            rank = rng.choice([r for r in range(world) if next_clock[r] < clocks])
            clock = next_clock[rank]
            now.now += rng.expovariate(4.0 if rank == 1 else 1.0 * world)
            claim = board.claim(rank, 0, clock, slack)
            if isinstance(claim, Wait):  # only while a rank has not claimed a clock this read needs
                assert slack is not None and claim.seconds > 0
                assert any(next_clock[q] < clock - slack for q in range(world))
                waits += 1
                continue
            answers[rank, clock] = claim
            for source, parts in [(clock, claim.owners), *claim.carried.items()]:
                for part, who in enumerate(parts):
                    if rank in who:
                        assert owners_of.setdefault((source, part), who) == who
                        computed.setdefault((source, part), set()).add(rank)
            for pair in claim.declare:
                assert pair not in declared
                declared.add(pair)
            next_clock[rank] += 1
        for clock in range(clocks):
            for part in range(world):
                assert sorted(computed[clock, part]) == sorted(owners_of[clock, part])
        for late, clock in declared:
            assert not answers[late, clock].computes(late)
        steals += len(declared)
    assert steals > 0 and (waits > 0) == (slack is not None)


def test_bad_claims_are_refused() -> None:
    board = ClaimBoard(2, late_after=0)
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
    assert board.answer(1, {"run": 0, "clock": 0}) == {"owners": [[0], [1]], "carried": [], "declare": []}


def test_a_malformed_answer_is_refused() -> None:
    good = {"owners": [[0], [0, 1]], "carried": [[2, [[], [0]]]], "declare": [[1, 3]]}
    assert Claim.from_wire(good, 2) == Claim([[0], [0, 1]], {2: [[], [0]]}, [(1, 3)])
    claim = Claim([[0], [1]], {4: [[0], []]}, [(0, 2)])
    assert Claim.from_wire(claim.to_wire(), 2) == claim
    bad_owners = ([[0]], [[0], [2]], [[0], [1, 1]], [[0], "1"], None, [[0], [True]])
    for bad in ([{**good, "owners": owners} for owners in bad_owners]
                + [{**good, "carried": [[2, owners]]} for owners in bad_owners]
                + [{**good, "carried": [[-1, [[], [0]]]]}, {**good, "carried": {"2": [[], [0]]}},
                   {**good, "declare": [[2, 0]]}, {**good, "declare": [[0, -1]]}, {**good, "declare": [[0]]},
                   {**good, "declare": None}, {"owners": [[0], [1]]}, None, [[0], [1]]]):
        with pytest.raises(InvalidArgumentError, match="answered a batch claim"):
            Claim.from_wire(bad, 2)


class _Clock:
    """A hand-moved clock for the board's claim times."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_rank_is_late_only_after_two_typical_clocks_of_silence() -> None:
    clock = _Clock()
    board = ClaimBoard(2, now=clock)
    for k in range(5):  # clocks of 1 s in step: the typical clock is 1 s
        board.claim(0, 0, k)
        board.claim(1, 0, k)
        clock.now += 1.0
    # Rank 1 claimed clock 4 at t = 4 and is silent; rank 0 runs on.
    board.claim(0, 0, 5)
    clock.now = 5.9
    assert board.claim(0, 0, 6).owners == [[0], [1]]  # 1.9 typical clocks: not yet late
    clock.now = 6.5
    # Late now: its unclaimed parts of clocks 5 and 6 move to clock 7, with its own.
    assert board.claim(0, 0, 7) == Claim([[0], [0]], {5: [[], [0]], 6: [[], [0]]}, [(1, 5), (1, 6), (1, 7)])
    assert not board.claim(1, 0, 5).computes(1)


def test_nobody_is_late_before_the_run_knows_its_typical_clock() -> None:
    clock = _Clock()
    board = ClaimBoard(2, now=clock)
    board.claim(0, 0, 0)
    board.claim(1, 0, 0)
    clock.now = 100.0
    assert board.claim(0, 0, 1).owners == [[0], [1]]
    assert board.claim(0, 0, 2).owners == [[0], [1]]  # rank 1 is a clock behind, but no clock is typical yet


def test_a_run_of_as_many_samples_a_clock_keeps_the_typical_clock() -> None:
    clock = _Clock()
    board = ClaimBoard(2, now=clock)
    for k in range(5):  # run 0, 128 samples a clock: clocks of 1 s in step
        for rank in (0, 1):
            board.claim(rank, 0, k, samples=128)
        clock.now += 1.0
    # Run 1 (the branch's next epoch) knows its typical clock from its first claims: rank 1,
    # silent since its claim of clock 0, is late at rank 0's claim of clock 2, 2.5 s later.
    for rank in (0, 1):
        board.claim(rank, 1, 0, samples=128)
    clock.now += 1.0
    board.claim(0, 1, 1, samples=128)
    clock.now += 1.5
    assert board.claim(0, 1, 2, samples=128).owners == [[0], [0]]
    # A run of other samples a clock (another batch size), or whose claims do not say, waits
    # for its own median.
    for run, samples in ((2, 256), (3, None)):
        for rank in (0, 1):
            board.claim(rank, run, 0, samples=samples)
        clock.now += 1.0
        board.claim(0, run, 1, samples=samples)
        clock.now += 10.0
        assert board.claim(0, run, 2, samples=samples).owners == [[0], [1]]


def test_a_thief_gets_the_time_of_the_parts_it_took() -> None:
    clock = _Clock()
    board = ClaimBoard(3, now=clock)
    for k in range(4):  # clocks of 1 s in step
        for rank in range(3):
            board.claim(rank, 0, k)
        clock.now += 1.0
    # Rank 2 falls silent; at 6.5 s ranks 0 and 1 take its parts of clocks 4 and 5.
    for rank in (0, 1):
        board.claim(rank, 0, 4)
    clock.now = 5.0
    board.claim(0, 0, 5)
    board.claim(1, 0, 5)
    clock.now = 6.5
    taken = board.claim(0, 0, 6)
    assert taken.declare == [(2, 4), (2, 5), (2, 6)] and taken.parts_of(1) == 2.5
    board.claim(1, 0, 6)  # at 6.5 s: rank 1 computes its part and half of three more
    clock.now = 7.0
    board.claim(0, 0, 7)
    clock.now = 8.9
    # Rank 1 is a clock behind and 2.4 s silent: more than two typical clocks, but less
    # than twice the 2.5 s its parts take, so not late.
    assert board.claim(0, 0, 8).owners[1] == [1]
    clock.now = 11.6
    assert board.claim(0, 0, 9).owners[1] == [0]  # 5.1 s: late


def _in_step(board: ClaimBoard, clock: _Clock, ranks: int, clocks: int) -> None:
    for k in range(clocks):  # clocks of 1 s in step: the typical clock is 1 s
        for rank in range(ranks):
            board.claim(rank, 0, k)
        clock.now += 1.0


def test_a_claim_whose_read_would_wait_waits_for_the_rank_to_turn_late() -> None:
    clock = _Clock()
    board = ClaimBoard(2, now=clock)
    _in_step(board, clock, 2, 10)
    # Rank 1 claimed clock 9 at t = 9 and is silent. At slack 1 rank 0 reads clock 12 only
    # after rank 1's clock 10 is in, so its claim of 12 waits while rank 1 is not late.
    for k in (10, 11):
        assert board.claim(0, 0, k, slack=1).owners == [[0], [1]]
    clock.now = 10.5
    assert board.claim(0, 0, 12, slack=1) == Wait(1 / 8)  # asked again an eighth of a clock later
    clock.now = 10.95
    assert board.claim(0, 0, 12, slack=1) == Wait(pytest.approx(0.05))  # until t = 11, when it is late
    clock.now = 11.1
    # Late: its unclaimed parts of clocks 10 and 11 move to rank 0 in clock 12, and all three are empty.
    assert board.claim(0, 0, 12, slack=1) == Claim([[0], [0]], {10: [[], [0]], 11: [[], [0]]},
                                                   [(1, 10), (1, 11), (1, 12)])
    clock.now = 11.2
    assert not board.claim(1, 0, 10).computes(1)  # rank 1 is back, and catches up on empty clocks
    # Its clocks up to 12 are empty: the shards do not wait for them, and neither do the claims.
    clock.now = 11.3
    assert board.claim(0, 0, 13, slack=1) == Claim([[0], [1]])
    assert board.claim(0, 0, 14, slack=1) == Claim([[0], [1]])
    assert isinstance(board.claim(0, 0, 15, slack=1), Wait)  # rank 1 still computes its part of 13


def test_a_wait_ends_when_the_rank_claims() -> None:
    clock = _Clock()
    board = ClaimBoard(3, now=clock)
    _in_step(board, clock, 3, 10)
    for rank in (0, 2):
        for k in (10, 11):
            assert board.claim(rank, 0, k, slack=1).owners == [[0], [1], [2]]
    clock.now = 10.5
    assert isinstance(board.claim(0, 0, 12, slack=1), Wait)
    assert isinstance(board.claim(2, 0, 12, slack=1), Wait)  # the decision waits for every claimant
    assert board.claim(1, 0, 10, slack=1).owners == [[0], [1], [2]]
    assert board.claim(0, 0, 12, slack=1) == Claim([[0], [1], [2]])
    assert board.claim(2, 0, 12, slack=1) == Claim([[0], [1], [2]])
    # Nobody waits before the run knows its typical clock.
    board.claim(0, 1, 0)
    assert board.claim(0, 1, 1, slack=0) == Claim([[0], [1], [2]])


def test_waits_go_over_the_wire() -> None:
    clock = _Clock()
    board = ClaimBoard(2, now=clock)
    _in_step(board, clock, 2, 10)
    board.claim(0, 0, 10)
    board.claim(0, 0, 11)
    assert board.answer(0, {"run": 0, "clock": 12, "slack": 1, "samples": 64}) == {"wait": 0.125}
    for bad in ({"slack": -1}, {"slack": 1, "samples": -5}, {"samples": 2.5}):
        with pytest.raises(InvalidArgumentError, match="non-negative integers"):
            board.answer(0, {"run": 0, "clock": 12, **bad})
    for answer, expected in (({"wait": 0.125}, Wait(0.125)), ({"wait": "soon"}, None),
                             ({"wait": float("nan")}, None), ({"wait": float("inf")}, None), ({"wait": -1}, None)):
        remote = ClaimsThroughRankZero(1, 2, lambda *_: None, lambda *_: answer, 1.0)
        if expected is None:
            with pytest.raises(InvalidArgumentError, match="a wait of"):
                remote.claim(1, 0, 11, 1)
        else:
            assert remote.claim(1, 0, 11, 1) == expected
