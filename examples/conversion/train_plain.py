"""A standard PyTorch training script: a small CNN on MNIST-1D, a DataLoader,
torch.optim.SGD with momentum and a StepLR schedule. The "before" of the
conversion guide in docs/torch.md; train_mltuner.py is the "after", and
tests/python/torch/test_conversion.py checks that the two train alike.

    python examples/conversion/train_plain.py --epochs 8
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

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

    data = load_mnist1d()
    train_set = TensorDataset(torch.tensor(data.x_train).unsqueeze(1), torch.tensor(data.y_train))
    test_set = TensorDataset(torch.tensor(data.x_test).unsqueeze(1), torch.tensor(data.y_test))
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed))  # a seeded shuffle
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=1000)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for epoch in range(args.epochs):
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        print(f"epoch {epoch + 1}: loss {losses[-1]:.3f}, test accuracy {evaluate(model, test_loader):.1%}")

    torch.save(model.state_dict(), "mnist1d_cnn.pt")
    if args.losses:
        with open(args.losses, "w") as file:
            json.dump(losses, file)


if __name__ == "__main__":
    main()
