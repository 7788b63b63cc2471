"""The conversion guide of docs/torch.md, kept true.

examples/conversion/train_plain.py is a standard PyTorch script (small CNN,
DataLoader, torch.optim.SGD with momentum, StepLR); train_mltuner.py is its
conversion, which keeps the optimizer and scheduler lines. The tests
check that the guide shows their real diff, that one worker trains exactly
like the plain script (the loss of every step within 1e-5), and that two
workers sharding the data with DistributedSampler(num_replicas=job.world_size,
rank=job.rank) train like plain SGD on both workers' batches together.

Each script runs as its own process (the converted one alone, or two ranks
on 127.0.0.1 with the variables mltuner launch sets), bounded in time.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DistributedSampler  # noqa: E402

from mltuner.launch._env import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "conversion"
PLAIN, CONVERTED = EXAMPLES / "train_plain.py", EXAMPLES / "train_mltuner.py"
GUIDE = ROOT / "docs" / "torch.md"
RUN_TIMEOUT_S = 240.0


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def guide_diff() -> str:
    """The scripts' unified diff past their module docstrings (which only
    describe each script), with the files' own line numbers."""
    plain, converted = _lines(PLAIN), _lines(CONVERTED)
    hunks = "".join(difflib.unified_diff(plain, converted, PLAIN.name, CONVERTED.name, n=1))
    docstring_end = [i for i, line in enumerate(plain) if line.startswith('"""')][1] + 1
    header, *parts = re.split(r"(?m)^(?=@@ )", hunks)
    kept = [part for part in parts if int(re.match(r"@@ -(\d+)", part)[1]) > docstring_end]  # type: ignore[index]
    return header + "".join(kept)


def _trimmed(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")  # editors trim line ends


def test_the_guide_shows_the_real_diff() -> None:
    blocks = [_trimmed(block) for block in re.findall(r"```diff\n(.*?)```", GUIDE.read_text(), flags=re.S)]
    assert _trimmed(guide_diff()) in blocks, (
        "docs/torch.md's conversion diff is not the example scripts' diff; it is now:\n" + guide_diff())


def _run(script: Path, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env={**base, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(processes: list[subprocess.Popen[str]]) -> list[str]:
    """Every process's output; each must exit 0 within the timeout. Kills
    the rest when one fails or hangs."""
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
            assert process.returncode == 0, output
            outputs.append(output)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    return outputs


def test_one_worker_trains_exactly_like_the_plain_script(tmp_path: Path) -> None:
    args = ["--epochs", "1", "--losses"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "ps").mkdir()
    _finish([_run(PLAIN, [*args, "losses.json"], tmp_path / "plain"),
             _run(CONVERTED, [*args, "losses.json"], tmp_path / "ps")])
    plain = json.loads((tmp_path / "plain" / "losses.json").read_text())
    converted = json.loads((tmp_path / "ps" / "losses.json").read_text())
    assert len(plain) == len(converted) == 125  # 4,000 samples in batches of 32
    worst = max(abs(a - b) for a, b in zip(plain[:100], converted[:100]))
    assert worst <= 1e-5, f"loss differs by {worst:.3g} within the first 100 steps"
    assert plain[99] < plain[0] - 0.2  # it trains: the comparison is not between two flat lines
    # Both end with the same weights (the converted one fetched from the servers).
    got = torch.load(tmp_path / "ps" / "mnist1d_cnn.pt")
    want = torch.load(tmp_path / "plain" / "mnist1d_cnn.pt")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)


def _reference_after_one_epoch(train_set: Any, world_size: int, batch_size: int, lr: float,
                               seed: int) -> dict[str, Any]:
    """Plain torch.optim.SGD on the concatenation of every rank's batch of
    each step, the ranks' samples drawn as DistributedSampler draws them."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from train_plain import Net
    finally:
        sys.path.remove(str(EXAMPLES))
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=seed)
        sampler.set_epoch(0)
        shards.append(list(sampler))
    assert sorted(sum(shards, [])) == list(range(len(train_set)))  # disjoint, and all of it
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # the scripts' optimizer
    for start in range(0, len(shards[0]), batch_size):
        index = torch.tensor(sum((shard[start:start + batch_size] for shard in shards), []))
        x, y = train_set[index]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def test_two_workers_shard_with_distributed_sampler(tmp_path: Path) -> None:
    from torch.utils.data import TensorDataset

    from mltuner.datasets import load_mnist1d

    world_size, port = 2, free_port("127.0.0.1")
    processes = []
    for rank in range(world_size):
        env = {"MLTUNER_RANK": str(rank), "MLTUNER_LOCAL_RANK": str(rank), "MLTUNER_WORLD_SIZE": str(world_size),
               "MLTUNER_MASTER_ADDR": "127.0.0.1", "MLTUNER_MASTER_PORT": str(port),
               "MLTUNER_SECRET": "test-secret"}
        processes.append(_run(CONVERTED, ["--epochs", "1", "--losses", "losses.json"], tmp_path, env))
    outputs = _finish(processes)
    assert all("epoch 1:" in output for output in outputs)
    # 2,000 samples a rank in batches of 32: 63 clocks each.
    assert len(json.loads((tmp_path / "losses.json").read_text())) == 63

    data = load_mnist1d()
    train_set = TensorDataset(torch.tensor(data.x_train).unsqueeze(1), torch.tensor(data.y_train))
    want = _reference_after_one_epoch(train_set, world_size, batch_size=32, lr=0.05, seed=0)
    got = torch.load(tmp_path / "mnist1d_cnn.pt")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
