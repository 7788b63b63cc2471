"""train_plain.py converted to a data-parallel job on the parameter server:
the "after" of the conversion guide in docs/torch.md, which shows the diff.

    mltuner launch -n 2 -- python examples/conversion/train_mltuner.py --epochs 8

or alone, as one worker: python examples/conversion/train_mltuner.py
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mltuner
import mltuner.torch
from mltuner.datasets import load_mnist1d  # the MNIST-1D data set, as numpy arrays


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, 16, 5, stride=2, padding=2)
        self.conv2 = nn.Conv1d(16, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(loader.dataset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--losses", default=None, help="write the loss of every step here (JSON)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    job = mltuner.Job()

    data = load_mnist1d()
    train_set = TensorDataset(torch.tensor(data.x_train).unsqueeze(1), torch.tensor(data.y_train))
    test_set = TensorDataset(torch.tensor(data.x_test).unsqueeze(1), torch.tensor(data.y_test))
    sampler = DistributedSampler(train_set, num_replicas=job.world_size, rank=job.rank, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=1000)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model = mltuner.torch.wrap(model, job.worker, optimizer=optimizer,
                               example_input=train_set[:args.batch_size][0])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        print(f"epoch {epoch + 1}: loss {losses[-1]:.3f}, test accuracy {evaluate(model, test_loader):.1%}")

    if job.rank == 0:
        torch.save(model.state_dict(), "mnist1d_cnn.pt")
    if args.losses and job.rank == 0:
        with open(args.losses, "w") as file:
            json.dump(losses, file)
    job.close()


if __name__ == "__main__":
    main()
