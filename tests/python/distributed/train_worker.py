"""One worker process of the distributed tests (run as a program, one per rank).

It joins the job described by the MLTUNER_* variables and runs one scenario:

- ``linear``: data-parallel linear regression (the model and data of
  tests/python/client/test_bsp_equals_sequential.py, made here from the same
  seed on every rank): each clock, rank r reads the parameters with the given
  slack, computes the float64 gradient on batch (clock, r) and sends it.
  Optional: save a checkpoint at a clock, restore one before training, die
  (SIGKILL itself) at a clock, sleep each clock to be slow, send a NaN, and
  train a second, larger table ("extra", --extra-rows rows of 16 floats,
  read and updated each clock with values derived from what was read) whose
  payloads are large enough for ZeroMQ to give them memory of their own.
- ``counters``: the SSP probe: every rank adds 1 per clock to its own row of a
  counter table and reads all rows with the given slack, recording
  (clock, row values) for the test to check against the staleness bound.

Results go to OUT/rank-R.npz. Exit status 0 on success; an mltuner error is
printed as one line "FAILED <ExceptionType>: message" and exits 3.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import mltuner

IN, OUT, BATCH, ROW_WIDTH = 20, 7, 8, 16


def make_data(num_workers: int, clocks: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(IN, OUT))
    true_b = rng.normal(size=OUT)
    x = rng.normal(size=(clocks, num_workers, BATCH, IN))
    y = x @ true_w + true_b + 0.1 * rng.normal(size=(clocks, num_workers, BATCH, OUT))
    w0 = (rng.uniform(0.1, 1.0, size=(IN, OUT)) * rng.choice([-1, 1], size=(IN, OUT))).astype(np.float32)
    b0 = (rng.uniform(0.1, 1.0, size=OUT) * rng.choice([-1, 1], size=OUT)).astype(np.float32)
    return {"x": x, "y": y, "w0": w0, "b0": b0}


def make_layout() -> mltuner.TensorLayout:
    return mltuner.TensorLayout(row_width=ROW_WIDTH).add("weight", (IN, OUT)).add("bias", (OUT,))


def linear(job: mltuner.Job, args: argparse.Namespace) -> dict[str, np.ndarray]:
    worker = job.worker
    layout = make_layout()
    table = worker.create_tensor_table("params", layout)
    read = worker.virtual_read(table, slack=args.slack)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    extra = None
    if args.extra_rows:
        extra = worker.create_table("extra", args.extra_rows, ROW_WIDTH)
        read_extra = worker.virtual_read(extra, slack=args.slack)
        worker.virtual_post_read(read_extra)
        update_extra = worker.virtual_pre_update(extra)
        worker.virtual_update(update_extra)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    # Data for the whole run (restored runs continue the same data stream).
    data = make_data(args.data_workers or job.world_size, args.total_clocks or args.clocks, args.seed)
    first_clock = 0
    if args.restore:
        first_clock = job.restore_checkpoint(args.restore)
    elif job.rank == 0:
        init = worker.pre_update(update)
        layout.view(init, "weight")[:] = data["w0"]
        layout.view(init, "bias")[:] = data["b0"]
        worker.update(update)
    worker.start_iterations()
    for step in range(args.clocks):
        clock = first_clock + step
        if args.die_at == clock and job.rank == args.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if job.rank == args.slow_rank:
            time.sleep(args.slow_s)
        params = worker.read(read)
        w = layout.view(params, "weight").astype(np.float64)
        b = layout.view(params, "bias").astype(np.float64)
        worker.post_read(read)
        x, y = data["x"][clock, job.rank], data["y"][clock, job.rank]
        residual = x @ w + b - y
        grad = worker.pre_update(update)
        layout.view(grad, "weight")[:] = x.T @ residual / len(x)
        layout.view(grad, "bias")[:] = residual.mean(axis=0)
        if job.rank == args.nan_rank and clock == args.nan_at:
            layout.view(grad, "weight")[0, 0] = np.nan
        worker.update(update)
        if extra is not None:
            seen = np.array(worker.read(read_extra))
            worker.post_read(read_extra)
            worker.pre_update(update_extra)[:] = np.sin(seen * 0.37 + job.rank + 0.1 * clock) * 0.01
            worker.update(update_extra)
        worker.clock()
        if args.save_at == clock + 1:
            saved = job.save_checkpoint(args.checkpoint)
            # Written now: a later crash must not lose what the test compares with.
            np.savez(os.path.join(args.out, f"rank-{job.rank}-saved.npz"), at_save=worker.fetch(table),
                     path=np.array(str(saved)))
    worker.sync()
    result = {"final": worker.fetch(table), "first_clock": np.array(first_clock)}
    if extra is not None:
        result["extra"] = worker.fetch(extra)
    return result


def counters(job: mltuner.Job, args: argparse.Namespace) -> dict[str, np.ndarray]:
    worker = job.worker
    table = worker.create_table("counters", job.world_size, 1)
    read = worker.virtual_read(table, slack=args.slack)
    worker.virtual_post_read(read)
    mine = worker.virtual_pre_update(table, [job.rank])
    worker.virtual_update(mine)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    seen = np.zeros((args.clocks, job.world_size), dtype=np.float32)
    rng = np.random.default_rng(job.rank)
    for clock in range(args.clocks):
        if job.rank == args.slow_rank:
            time.sleep(args.slow_s)
        else:
            time.sleep(rng.uniform(0, 0.002))
        seen[clock] = np.asarray(worker.read(read))[:, 0]
        worker.post_read(read)
        worker.pre_update(mine)[:] = 1.0
        worker.update(mine)
        worker.clock()
    return {"seen": seen}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", choices=["linear", "counters"], default="linear")
    parser.add_argument("--rule", default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clocks", type=int, default=30)
    parser.add_argument("--total-clocks", type=int, default=0, help="length of the data stream")
    parser.add_argument("--data-workers", type=int, default=0, help="workers the data stream was made for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--extra-rows", type=int, default=0, help="rows of the second table (0: none)")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--restore", default="")
    parser.add_argument("--nan-rank", type=int, default=-1, help="this rank sends a NaN gradient value ...")
    parser.add_argument("--nan-at", type=int, default=-1, help="... at this clock")
    parser.add_argument("--check-finite", action="store_true")
    parser.add_argument("--secure", action="store_true")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument("--part-bytes", type=int, help="Config.clock_part_bytes (default: Config's)")
    args = parser.parse_args()
    parts = {} if args.part_bytes is None else {"clock_part_bytes": args.part_bytes}
    rate = {} if args.rule == "add" else {"learning_rate": args.lr}  # the add rule has none
    config = mltuner.Config(update_rule=mltuner.UpdateRule(args.rule, **rate), wait_timeout_s=30,
                            check_finite=args.check_finite, **parts)
    try:
        with mltuner.Job(config, secure=True if args.secure else None,
                         heartbeat_timeout_s=args.heartbeat_timeout, rendezvous_timeout_s=30) as job:
            result = linear(job, args) if args.scenario == "linear" else counters(job, args)
            result["rejected"] = np.array(job.rejected_messages)
            result["in_place"] = np.array(job._node.payloads_used_in_place)  # noqa: SLF001 - for the tests
            result["messages_received"] = np.array(job.worker.stats["messages_received"])
            result["ipc_received_bytes"] = np.array(job.transport_stats["cuda_ipc_received_bytes"])
            result["data_paths"] = np.array(sorted(set(job.data_paths.values())))
            np.savez(os.path.join(args.out, f"rank-{job.rank}.npz"), **result)
    except mltuner.MltunerError as error:
        print(f"FAILED {type(error).__name__}: {error}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
