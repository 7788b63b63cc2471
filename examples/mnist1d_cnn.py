"""A PyTorch training loop with in-training tuning: the MNIST-1D CNN on N
workers, the tuner choosing learning rate, momentum, batch size and staleness.

    mltuner run -n 2 -- python3 examples/mnist1d_cnn.py --max-epochs 20 [--steal-batches]

Each clock the session says which branch runs and which samples this worker
takes; the loop does one forward/backward pass through the wrapped model and
reports the loss (and, on validation clocks, the accuracy). The loss is
weighted by ``step.weight``, 1.0 unless the session moves samples between
workers: with ``--steal-batches`` a worker a whole clock behind loses its
part of the clock to the others (at staleness >= 1), and then has no
samples: its update is zero. Rank 0 runs the
tuner; `mltuner run` shows its decisions live and draws the report. The
complete program behind `mltuner demo` is python/mltuner/apps/mnist1d.py.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch
from mltuner.datasets import load_mnist1d
from mltuner.tune import BranchKind, TunerConfig, TuningSession, default_space


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(1, 25, 5, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(25, 25, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(25, 25, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(125, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--trials", type=int, default=30, help="trial cap of the initial search")
    parser.add_argument("--steal-batches", action="store_true", help="late workers' parts go to the others")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = load_mnist1d(num_samples=args.samples)
    cut = len(data.x_train) * 9 // 10  # the last 10% of the training split validates
    x_train, y_train = torch.tensor(data.x_train[:cut]).unsqueeze(1), torch.tensor(data.y_train[:cut])
    x_val, y_val = torch.tensor(data.x_train[cut:]).unsqueeze(1), torch.tensor(data.y_train[cut:])

    space = default_space([16, 32, 64], lr_range=(1e-3, 1.0))
    config = mlt.Config(update_rule=mlt.UpdateRule("damped_momentum", learning_rate=0.01, momentum=0.9), branches=True)
    with mlt.Job(config) as job:
        model = mltuner.torch.wrap(cnn(), job.worker, example_input=x_train[:32],
                                   example_loss=lambda out: nn.functional.cross_entropy(out, y_train[:32]))
        session = TuningSession(job, space, num_train=len(x_train), num_validation=len(x_val),
                                config=TunerConfig(max_epochs=args.max_epochs, max_trials_per_search=args.trials),
                                steal_batches=args.steal_batches)
        for step in session:
            testing = step.kind is BranchKind.TESTING
            x, y = (x_val, y_val) if testing else (x_train, y_train)
            index = torch.as_tensor(step.indices, dtype=torch.long)
            logits = model(x[index])
            # No samples (a part the others took): an update of zeros; a mean over none would be NaN.
            loss = nn.functional.cross_entropy(logits, y[index]) if len(index) else logits.sum() * 0.0
            (loss * step.weight).backward()
            model.step()
            accuracy = (logits.argmax(1) == y[index]).float().mean().item() if testing and len(index) else None
            step.report(loss.item(), accuracy=accuracy)
        if job.rank == 0 and session.final_branch is not None:
            trained = cnn()
            trained.load_state_dict(model.state_dict(branch=session.final_branch))
            with torch.no_grad():
                test = (trained(torch.tensor(data.x_test).unsqueeze(1)).argmax(1) == torch.tensor(data.y_test))
            print(f"test accuracy {test.float().mean():.1%} with {session.final_tunables}")


if __name__ == "__main__":
    main()
