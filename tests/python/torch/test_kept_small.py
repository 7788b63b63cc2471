"""With store_activations, tiny saved tensors (batch norm's per-channel
statistics, layer norm's per-row ones) stay with autograd instead of going
through the local table: each would cost the training thread a pack, an
unpack and four engine ops a clock for a few hundred bytes. The rule
(``_saved.keep_small``): the smallest first, each of at most 64 KiB, all of
them at most 1/64 of the clock's saved bytes, never one a recomputation
reads."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402
from mltuner.torch._recording import Slot  # noqa: E402
from mltuner.torch._saved import KEEP_MAX_BYTES, KEEP_SHARE, keep_small  # noqa: E402

CLOCKS, BATCH, LR = 4, 8, 0.05


def slot(*shape: int) -> Slot:
    return Slot(shape, torch.float32)


def test_the_smallest_are_kept_up_to_a_share_of_the_saved_bytes() -> None:
    big = slot(64, 64, 16, 16)  # 4 MiB
    stats = [slot(64) for _ in range(6)]  # 256 B each
    slots = [big, *stats, big]
    assert keep_small(slots) == set(range(1, 7))
    # Never one excluded (read by a recomputation), nor a recomputed one.
    assert keep_small(slots, excluded={2}) == {1, 3, 4, 5, 6}
    # The share: equal small tensors only, so all of them cannot be kept.
    many = [slot(16) for _ in range(200)]  # 64 B each, 12,800 B in all
    kept = keep_small(many)
    assert len(kept) == int(KEEP_SHARE * 200 * 64) // 64 == 3
    assert kept == {0, 1, 2}  # ties: forward order
    # The size: a tensor above KEEP_MAX_BYTES is stored however small its share.
    above = slot(KEEP_MAX_BYTES // 4 + 1)
    assert keep_small([above] + [big] * 200) == set()


class ConvNet(nn.Module):
    """Convolutions and batch norm: the norm saves two per-channel vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return ConvNet()


def test_batch_norm_statistics_stay_with_autograd_and_training_matches_torch() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(CLOCKS, BATCH, 3, 8, 8, generator=generator)
    y = torch.randint(0, 10, (CLOCKS, BATCH), generator=generator)
    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=LR))
    with LocalCluster(1, config) as cluster:
        ps_model = mt.wrap(make_model(), cluster.worker(0), example_input=x[0], store_activations=True,
                           recompute="none", example_loss=lambda out: nn.functional.cross_entropy(out, y[0]))
        kept = [line for line in ps_model.saved_activations if line.endswith("kept by autograd (small)")]
        # Both norms' save_mean and save_invstd, nothing else.
        assert len(kept) == 4 and all(" (8,) torch.float32" in line for line in kept), ps_model.saved_activations
        stored = len(ps_model.saved_activations) - len(kept)
        assert stored >= 4
        # Only the stored ones reach the engine, each stored and loaded once.
        assert sum(a.startswith("store of") for a in ps_model.accesses) == stored
        assert sum(a.startswith("load of") for a in ps_model.accesses) == stored
        kept_numbers = {line.split(" ")[0] for line in kept}
        assert not [a for a in ps_model.accesses if a.split(" (")[0].rsplit(" ", 1)[-1] in kept_numbers]
        assert f"; 4 small ones kept by autograd ({4 * 8 * 4} B)" in ps_model.plan
        for c in range(CLOCKS):
            nn.functional.cross_entropy(ps_model(x[c]), y[c]).backward()
            ps_model.step()
            optimizer.zero_grad()
            nn.functional.cross_entropy(reference(x[c]), y[c]).backward()
            optimizer.step()
        trained = ps_model.unwrap()
        for (name, got), want in zip(trained.named_parameters(), reference.parameters()):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name
        for (name, got), want in zip(trained.named_buffers(), reference.buffers()):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name
