"""One worker process of the batch-balancing and -stealing tests (run as a
program, one per rank): linear regression in a TuningSession with
``balance_batches=True`` (or ``--steal``: ``steal_batches=True`` at read
slack ``--slack``); ``--slow-rank`` sleeps after every ``--slow-every``-th
of its clocks, and ``--burst-s`` longer once a run after its ``--burst-at``-th;
``--work-s`` makes each clock's compute take time in proportion to its samples. ``--rule add`` sums each step's weighted mean input row
instead of a gradient step, so that the final table is the same sum
whoever computed which sample.

Rank 0's driver trains one branch for ``--runs`` runs of ``--clocks`` clocks
and then validates it once. Each rank writes to OUT/rank-R.npz the indices it
trained on per clock, its steps' weights, the final parameters, the
shares of the last run and the clocks it gave and took; per training
clock its branch clock, its read's data age and the time of the read; its
longest read and the seconds its claims waited; and the slow rank its pauses
(start, end, the branch clock before them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

import mltuner
from mltuner.tune import BranchKind, BranchSystem, Choice, LogUniform, SearchSpace, TuningSession

IN, NUM_TRAIN, NUM_VAL, BATCH, LR = 6, 400, 40, 8, 0.05


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(NUM_TRAIN + NUM_VAL, IN))
    return x, x @ rng.normal(size=IN) + 0.1 * rng.normal(size=NUM_TRAIN + NUM_VAL)


class _Ended:
    def __init__(self, branch: int, tunables: dict[str, Any]) -> None:
        self.branch, self.tunables = branch, tunables


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--clocks", type=int, default=8)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-s", type=float, default=0.02)
    parser.add_argument("--slow-every", type=int, default=1)
    parser.add_argument("--work-s", type=float, default=0.0, help="seconds of compute per BATCH samples")
    parser.add_argument("--burst-s", type=float, default=0.0, help="a longer pause of the slow rank, once a run")
    parser.add_argument("--burst-at", type=int, default=8, help="after this training clock of each run")
    parser.add_argument("--steal", action="store_true")
    parser.add_argument("--steal-after", type=float, default=2.0)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--rule", choices=("sgd", "add"), default="sgd")
    args = parser.parse_args()
    setting = {"lr": LR, "batch_size": BATCH}

    def driver(system: BranchSystem) -> _Ended:
        root = system.fork(None, setting, BranchKind.INIT)
        branch = system.fork(root, setting, BranchKind.TRAINING)
        for _ in range(args.runs):
            system.run(branch, args.clocks)
        testing = system.fork(branch, setting, BranchKind.TESTING)
        system.run(testing, session.config.num_clocks_to_test)
        system.free(testing)
        return _Ended(branch, setting)

    rule = mltuner.UpdateRule("sgd", learning_rate=LR) if args.rule == "sgd" else mltuner.UpdateRule("add")
    config = mltuner.Config(update_rule=rule, branches=True, max_branches=40, wait_timeout_s=30)
    space = SearchSpace([LogUniform("lr", 1e-3, 1.0, default=LR),
                         Choice("batch_size", [BATCH], default=BATCH, search=False)])
    x, y = make_data()
    try:
        with mltuner.Job(config, rendezvous_timeout_s=30) as job:
            worker = job.worker
            table = worker.create_table("w", 1, IN)
            read = worker.virtual_read(table, slack=args.slack)
            worker.virtual_post_read(read)
            grad = worker.virtual_pre_update(table)
            worker.virtual_update(grad)
            worker.virtual_clock()
            worker.finish_virtual_iteration()
            worker.start_iterations()
            session = TuningSession(job, space, num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver,
                                    balance_batches=not args.steal, steal_batches=args.steal,
                                    steal_after=args.steal_after)
            trained: list[np.ndarray] = []
            validated: list[np.ndarray] = []
            weights: list[float] = []
            seen: list[tuple[float, int, int]] = []  # (time, branch clock, data age) of training reads
            pauses: list[tuple[float, float, int]] = []
            switch_during = 0.0
            longest_read = 0.0  # seconds
            for step in session:
                switch_during = max(switch_during, sys.getswitchinterval())
                asked = time.monotonic()
                w = np.asarray(worker.read(read), dtype=np.float64)[0]
                longest_read = max(longest_read, time.monotonic() - asked)
                if step.kind is not BranchKind.TESTING:
                    seen.append((time.time(), step.clock, worker.last_read_data_age))
                worker.post_read(read)
                if step.kind is BranchKind.TESTING:
                    validated.append(step.indices)
                    worker.pre_update(grad)[:] = 0.0
                    step.report(0.0, accuracy=1.0)
                else:
                    trained.append(step.indices)
                    weights.append(step.weight)
                    xs, ys = x[step.indices], y[step.indices]
                    time.sleep(args.work_s * len(xs) / BATCH)  # compute in proportion to the samples
                    if not len(xs):  # the other rank took this clock's part
                        worker.pre_update(grad)[:] = 0.0
                        step.report(0.0)
                    elif args.rule == "add":
                        worker.pre_update(grad)[0] = xs.mean(axis=0) * step.weight
                        step.report(0.0)
                    else:
                        residual = xs @ w - ys
                        worker.pre_update(grad)[0] = xs.T @ residual / len(xs) * step.weight
                        step.report(float(np.mean(residual ** 2)))
                worker.update(grad)
                worker.clock()
                if job.rank == args.slow_rank and len(trained) % args.slow_every == 0:
                    began = time.time()
                    burst = step.kind is not BranchKind.TESTING and len(trained) % args.clocks == args.burst_at
                    time.sleep(args.slow_s + (args.burst_s if burst else 0.0))
                    pauses.append((began, time.time(), step.clock))
            worker.sync()
            assert session.final_branch is not None
            np.savez(os.path.join(args.out, f"rank-{job.rank}.npz"),
                     final=np.asarray(worker.fetch(table, branch=session.final_branch))[0],
                     trained=np.concatenate(trained), counts=np.array([len(i) for i in trained]),
                     weights=np.array(weights), validated=np.concatenate(validated),
                     shares=np.array(session.batch_shares or []),
                     given=session.clocks_given, taken=session.clocks_taken, shared=session.claims_shared,
                     claim_wait=session.claim_wait_s, longest_read=longest_read,
                     switch=[switch_during, sys.getswitchinterval()],
                     seen=np.array(seen).reshape(-1, 3), pauses=np.array(pauses).reshape(-1, 3))
    except mltuner.MltunerError as error:
        print(f"FAILED {type(error).__name__}: {error}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
