"""The adapter on the CUDA backend: engine buffers are GPU memory, reached
through DLPack with no copy; training matches plain torch on the same GPU,
and a budget smaller than the model gives the same results as none.

Runs where mltuner was built with nvcc, a GPU is visible and torch has
CUDA (the lent device); skipped elsewhere with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner.client._worker import OP_KINDS  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402

pytestmark = pytest.mark.gpu
if mltuner.cuda_device_count() == 0 or not torch.cuda.is_available():
    pytest.skip(
        f"needs the CUDA backend, a visible GPU and torch with CUDA (built with CUDA: {mltuner.cuda_built()}, "
        f"engine devices: {mltuner.cuda_device_count()}, torch.cuda: {torch.cuda.is_available()})",
        allow_module_level=True,
    )

GPU = torch.device("cuda", 0)
CLOCKS, BATCH, WIDTH = 12, 16, 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv1d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten()]
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 10)).to(GPU)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(CLOCKS, BATCH, 4, 8, generator=generator)
    return x.to(GPU), torch.randint(0, 10, (CLOCKS, BATCH), generator=generator).to(GPU)


def train(budget: int, store_activations: bool) -> tuple[dict[str, torch.Tensor], list[float], dict[str, Any]]:
    x, y = make_data()
    config = Config(device="cuda", device_memory_budget=budget, wait_timeout_s=30,
                    update_rule=UpdateRule("momentum", learning_rate=0.05, momentum=0.9))
    with LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(make_model(), worker, example_input=x[0], store_activations=store_activations)
        losses = []
        for c in range(CLOCKS):
            loss = F.cross_entropy(ps_model(x[c]), y[c])
            loss.backward()
            ps_model.step()
            losses.append(loss.item())
        return ps_model.state_dict(), losses, worker.stats


OP_NAMES = {number: name for name, number in OP_KINDS.items()}


def test_cuda_training_matches_torch_and_swapping_changes_nothing() -> None:
    x, y = make_data()
    reference = make_model()
    history = [torch.zeros_like(p) for p in reference.parameters()]
    want_losses = []
    for c in range(CLOCKS):  # the server's momentum rule, in plain torch on the same GPU
        loss = F.cross_entropy(reference(x[c]), y[c])
        loss.backward()
        want_losses.append(loss.item())
        with torch.no_grad():
            for p, h in zip(reference.parameters(), history):
                assert p.grad is not None
                h.copy_(0.1 * p.grad + 0.9 * h)
                p.sub_(0.05 * h)
                p.grad = None

    plain, plain_losses, _ = train(0, store_activations=False)
    unlimited, losses, stats = train(0, store_activations=True)
    budget = stats["pool_min_bytes"]
    model_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    assert budget < model_bytes
    limited, limited_losses, limited_stats = train(budget, store_activations=True)
    assert limited_stats["host_store_bytes"] > 0 and limited_stats["bytes_swapped_in"] > 0

    want = reference.state_dict()
    for name, value in want.items():
        scale = float(value.abs().max())
        assert float((plain[name] - value).abs().max()) <= 1e-5 * scale, name
        assert plain[name].device == GPU
        assert torch.equal(unlimited[name], plain[name]), name
        assert torch.equal(limited[name], plain[name]), name
    assert max(abs(a - b) for a, b in zip(plain_losses, want_losses)) <= 1e-5 * max(want_losses)
    assert losses == plain_losses == limited_losses


def test_parameters_live_in_the_engines_gpu_buffers() -> None:
    model = make_model()
    x, _ = make_data()
    with LocalCluster(1, Config(device="cuda", wait_timeout_s=30)) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(model, worker, example_input=x[0])
        reads: list[int] = []
        real_run = worker._run_ops

        def spy_run(ops: Any, stream: int) -> Any:  # the light clock opens its reads in one batch
            buffers = real_run(ops, stream)
            opens = [OP_NAMES[op[0]] for op in ops if OP_NAMES[op[0]] in ("read", "pre_update", "local_access")]
            for kind, buffer in zip(opens, buffers):
                assert isinstance(buffer, mltuner.DeviceArray)
                if kind == "read":
                    reads.append(int(buffer.data_ptr))
            return buffers

        worker._run_ops = spy_run  # type: ignore[method-assign]
        seen: list[int] = []
        model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.untyped_storage().data_ptr()))
        ps_model(x[0]).sum().backward()
        ps_model.step()
        assert seen and seen[0] == reads[0]  # the first read is layer 0's forward read


def test_a_cpu_model_on_a_cuda_engine_is_refused() -> None:
    x, _ = make_data()
    with LocalCluster(1, Config(device="cuda", wait_timeout_s=30)) as cluster:
        with pytest.raises(mltuner.InvalidArgumentError, match="buffers are on cuda:0 but the model's parameters are on cpu"):
            mt.wrap(make_model().cpu(), cluster.worker(0), example_input=x[0].cpu())


class _ConvBlock(nn.Module):
    """Conv, batch norm (cuDNN's), in-place ReLU, plus the input: what
    recomputing re-runs on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


def test_cuda_recompute_matches_storing_bit_for_bit() -> None:
    """Recomputing batch norm, ReLU and dropout (the fused native_dropout,
    with its random state replayed) on the GPU gives the bits of storing
    every saved activation, and leaves the random stream as it was."""
    def conv_net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                             _ConvBlock(), _ConvBlock(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 10)).to(GPU)

    def encoder() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
                               for _ in range(2)]).to(GPU)

    generator = torch.Generator().manual_seed(2)
    images = torch.randn(4, 8, 3, 8, 8, generator=generator).to(GPU)
    tokens = torch.randn(4, 8, 16, 32, generator=generator).to(GPU)
    for make, inputs in ((conv_net, images), (encoder, tokens)):
        results = {}
        for recompute in ("none", "cheap"):
            torch.manual_seed(5)
            with LocalCluster(1, Config(device="cuda", wait_timeout_s=30)) as cluster:
                ps_model = mt.wrap(make(), cluster.worker(0), example_input=inputs[0], store_activations=True,
                                   recompute=recompute)
                for step in range(len(inputs)):
                    ps_model(inputs[step]).float().pow(2).mean().backward()
                    ps_model.step()
                results[recompute] = (ps_model.state_dict(), ps_model.saved_activations,
                                      torch.rand(4, device=GPU))
        (want, _, want_random), (got, saved, got_random) = results["none"], results["cheap"]
        for name, value in want.items():
            assert torch.equal(got[name], value), name
        assert torch.equal(got_random, want_random)
        lines = [line for line in saved if ": recomputed" in line]
        assert lines, saved
        if make is encoder:
            assert any("native_dropout" in line for line in lines), saved


def test_stored_activations_leave_torch_during_the_forward_and_reused_addresses_stay_apart() -> None:
    """Once a stored activation's copy is on the stream, the adapter holds
    nothing of it: torch's peak during the forward stays near one block's
    activations, not all of them (a budget would bound only the engine's
    memory otherwise). Torch's caching allocator then hands each block the
    address the block before freed, with the same shape and version: each
    is still a saved activation of its own, and training matches torch."""
    blocks, batch, width = 8, 1024, 256  # 1 MiB per activation

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))).to(GPU)

    x = torch.randn(batch, width, device=GPU)
    activation = batch * width * 4
    reference = build()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    with LocalCluster(1, Config(device="cuda", wait_timeout_s=30, update_rule=UpdateRule("sgd", learning_rate=0.05))
                      ) as cluster:
        ps_model = mt.wrap(build(), cluster.worker(0), example_input=x, store_activations=True, recompute="none")
        for _ in range(4):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(GPU)
            torch.cuda.reset_peak_memory_stats(GPU)
            out = ps_model(x)
            peak = torch.cuda.max_memory_allocated(GPU) - before
            assert peak <= 4 * activation, f"{peak / activation:.1f} activations alive at once"
            out.square().mean().backward()
            ps_model.step()
            optimizer.zero_grad()
            reference(x).square().mean().backward()
            optimizer.step()
        for (name, got), want in zip(ps_model.unwrap().named_parameters(), reference.parameters()):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), name
