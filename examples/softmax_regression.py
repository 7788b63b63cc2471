"""Data-parallel softmax regression on N workers through the parameter server.

Every worker is a process of a `mltuner.Job` (alone, a job of one; under
`mltuner launch -n N`, torchrun, Slurm or Open MPI, one of N), with its own
engine and server shard. Each clock, a worker reads the weights (fresh within `--slack`
clocks), computes the gradient of its own mini-batch, and hands it to the
engine; the shards average the workers' gradients and apply MLtuner's damped
momentum SGD.

The data set is generated here (a fixed-seed mixture of Gaussians, 10 classes
in 64 dimensions), so the example needs nothing but numpy.

    mltuner launch -n 2 -- python examples/softmax_regression.py --clocks 300
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import mltuner as mlt

NUM_CLASSES = 10
NUM_FEATURES = 64


def make_dataset(num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs whose class means overlap enough that accuracy < 100%."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 1.0, size=(NUM_CLASSES, NUM_FEATURES))
    labels = rng.integers(0, NUM_CLASSES, size=num_samples)
    features = means[labels] + rng.normal(0.0, 2.5, size=(num_samples, NUM_FEATURES))
    return features.astype(np.float32), labels


def softmax_loss_and_grad(
    weight: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    logits = x @ weight + bias
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
    probs[np.arange(len(y)), y] -= 1.0
    probs /= len(y)
    return loss, x.T @ probs, probs.sum(axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clocks", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--slack", type=int, default=0, help="0 = BSP, s > 0 = SSP")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    args = parser.parse_args()

    train_x, train_y = make_dataset(20000, seed=1)
    test_x, test_y = make_dataset(5000, seed=2)
    # The same class means for both splits: make_dataset draws them first from
    # the seed, so re-draw test points around the training means.
    rng = np.random.default_rng(3)
    means = np.stack([train_x[train_y == c].mean(axis=0) for c in range(NUM_CLASSES)])
    test_x = (means[test_y] + rng.normal(0.0, 2.5, size=test_x.shape)).astype(np.float32)

    layout = mlt.TensorLayout(row_width=128)
    layout.add("weight", (NUM_FEATURES, NUM_CLASSES)).add("bias", (NUM_CLASSES,))
    config = mlt.Config(update_rule=mlt.UpdateRule("damped_momentum", learning_rate=args.learning_rate, momentum=0.9))
    losses: list[float] = []

    def train(worker: mlt.Worker) -> np.ndarray:
        params = worker.create_tensor_table("softmax", layout)
        read = worker.virtual_read(params, slack=args.slack)
        worker.virtual_post_read(read)
        grad = worker.virtual_pre_update(params)
        worker.virtual_update(grad)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        if worker.rank == 0:  # initial weights: small random values
            init = worker.pre_update(grad)
            init[...] = layout.pack({"weight": np.random.default_rng(0).normal(0, 0.01, (NUM_FEATURES, NUM_CLASSES))})
            worker.update(grad)
        worker.start_iterations()
        rng = np.random.default_rng(100 + worker.rank)
        for _ in range(args.clocks):
            buffer = worker.read(read)
            weight, bias = layout.view(buffer, "weight"), layout.view(buffer, "bias")
            batch = rng.integers(0, len(train_x), size=args.batch_size)
            loss, grad_w, grad_b = softmax_loss_and_grad(weight, bias, train_x[batch], train_y[batch])
            worker.post_read(read)
            out = worker.pre_update(grad)
            layout.view(out, "weight")[...] = grad_w
            layout.view(out, "bias")[...] = grad_b
            worker.update(grad)
            worker.clock()
            losses.append(loss)
        worker.sync()
        return worker.fetch(params)

    start = time.perf_counter()
    with mlt.Job(config) as job:
        final = train(job.worker)
        stats = job.worker.stats
        workers = job.world_size
        if job.rank != 0:
            return  # rank 0 reports for the job
    elapsed = time.perf_counter() - start

    weight, bias = layout.view(final, "weight"), layout.view(final, "bias")
    accuracy = float(((test_x @ weight + bias).argmax(axis=1) == test_y).mean())
    first = np.mean(losses[:20])
    last = np.mean(losses[-20:])
    print(f"workers={workers} slack={args.slack} clocks={args.clocks} time={elapsed:.2f}s")
    print(f"training loss {first:.3f} -> {last:.3f}; test accuracy {accuracy:.1%}")
    print(f"worker 0 stalled {stats['stall_seconds']:.3f}s waiting for buffers")


if __name__ == "__main__":
    main()
