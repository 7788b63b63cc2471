"""The claim board in a file shared by the ranks of one host: handles on
the same file act as one board, real processes claiming at once still
compute every part once, a held lock ends in a timeout, and a damaged file
is named."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest

from mltuner.exceptions import WaitTimeoutError
from mltuner.tune import TuningError
from mltuner.tune.session._shared_board import SharedClaimBoard, new_board_file
from mltuner.tune.session._steal import Claim, ClaimBoard, Wait


@pytest.fixture
def board_file():  # type: ignore[no-untyped-def]
    path = new_board_file()
    yield path
    Path(path).unlink(missing_ok=True)


def test_handles_on_one_file_act_as_one_board(board_file: str) -> None:
    first, second = (SharedClaimBoard(board_file, 2, timeout_s=5, late_after=0) for _ in range(2))
    first.claim(0, 1, 0)
    second.claim(1, 1, 0)
    assert first.claim(0, 1, 1).owners == [[0], [1]]
    assert first.claim(0, 1, 2) == Claim([[0], [0]], {1: [[], [0]]}, [(1, 1), (1, 2)])
    assert second.claim(1, 1, 1) == Claim([[0], []], {}, [])  # what rank 0's handle decided
    with pytest.raises(Exception, match="its next is 2"):
        second.claim(1, 1, 1)
    first.close()
    second.close()


def test_a_wait_leaves_the_file_as_it_was(board_file: str) -> None:
    now = [0.0]
    board = SharedClaimBoard(board_file, 2, timeout_s=5, now=lambda: now[0])
    for k in range(10):  # clocks of 1 s in step; then rank 1 is silent
        board.claim(0, 0, k)
        board.claim(1, 0, k)
        now[0] += 1.0
    board.claim(0, 0, 10)
    board.claim(0, 0, 11)
    before = Path(board_file).read_bytes()
    now[0] = 10.5
    assert board.claim(0, 0, 12, slack=1) == Wait(0.125)
    assert Path(board_file).read_bytes() == before
    now[0] = 11.5
    assert board.claim(0, 0, 12, slack=1).declare == [(1, 10), (1, 11), (1, 12)]
    board.close()


def test_a_boards_state_carries_its_decisions() -> None:
    board = ClaimBoard(3, late_after=0)
    for rank in (0, 1):
        board.claim(rank, 4, 0)
    board.claim(0, 4, 1)  # rank 2 is late
    copy = ClaimBoard(3, late_after=0)
    copy.load(board.state())
    assert copy.claim(2, 4, 0) == board.claim(2, 4, 0)
    assert copy.claim(1, 4, 1) == board.claim(1, 4, 1)


def _claimer(path: str, rank: int, clocks: int, answers) -> None:  # type: ignore[no-untyped-def]
    board = SharedClaimBoard(path, 3, timeout_s=30, late_after=0)
    rng = random.Random(rank)
    for clock in range(clocks):
        answers.put((rank, clock, board.claim(rank, 0, clock).to_wire()))
        time.sleep(rng.random() * 0.002)


def test_processes_claiming_at_once_compute_every_part_once(board_file: str) -> None:
    clocks = 40
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    procs = [context.Process(target=_claimer, args=(board_file, rank, clocks, answers)) for rank in range(3)]
    for proc in procs:
        proc.start()
    got = [answers.get(timeout=60) for _ in range(3 * clocks)]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    owners_of: dict[tuple[int, int], list[int]] = {}
    computed: dict[tuple[int, int], set[int]] = {}
    for rank, clock, wire in got:
        claim = Claim.from_wire(wire, 3)
        for source, parts in [(clock, claim.owners), *claim.carried.items()]:
            for part, who in enumerate(parts):
                if rank in who:
                    assert owners_of.setdefault((source, part), who) == who
                    computed.setdefault((source, part), set()).add(rank)
    for clock in range(clocks):
        for part in range(3):
            assert sorted(computed[clock, part]) == sorted(owners_of[clock, part])


def test_a_held_lock_ends_in_a_timeout(board_file: str) -> None:
    board = SharedClaimBoard(board_file, 2, timeout_s=0.05)
    holder = os.open(board_file, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(WaitTimeoutError, match="claim board's lock"):
            board.claim(0, 0, 0)
    finally:
        os.close(holder)
    board.claim(0, 0, 0)  # released with the holder's file
    board.close()


def test_a_damaged_file_is_named(board_file: str) -> None:
    Path(board_file).write_text('{"run": 1, "la')
    board = SharedClaimBoard(board_file, 2, timeout_s=1)
    with pytest.raises(TuningError, match="is corrupt"):
        board.claim(0, 0, 0)
    board.close()
