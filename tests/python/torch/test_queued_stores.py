"""With store_activations, the forward's stores go to the engine queued with
the next layer's read (the engine copies the saved bytes itself), and every
post rides with the next engine call: fewer engine calls per clock, the same
ops in the same order, the same bits. An activation changed in place after
autograd saved it is refused, as torch's own backward refuses it."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule  # noqa: E402
from mltuner.torch import UnsupportedModelError  # noqa: E402

CLOCKS = 3


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def config(**kwargs: Any) -> Config:
    return Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=0.1), **kwargs)


def reference_step(reference: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    reference(x).square().mean().backward()
    optimizer.step()


def assert_same_parameters(ps_model: Any, reference: nn.Module) -> None:
    for (name, got), want in zip(ps_model.unwrap().named_parameters(), reference.parameters()):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name


def test_a_clock_costs_one_engine_call_per_layer_each_way_and_training_matches_torch() -> None:
    """The forward: a call per read, the stores riding with the next one.
    The backward, without held reads: a layer needs its saved tensors and
    its parameters read again, and the loads and the read recorded next to
    each other open in one call, whichever autograd asks for first."""
    model, reference = make_model(), make_model()
    x = torch.randn(8, 16)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with LocalCluster(1, config()) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(model, worker, example_input=x, store_activations=True, recompute="none",
                           example_loss=lambda out: out.square().mean())
        assert not ps_model.hold_reads
        layers = len(ps_model.layers)
        reads = sum(a.startswith("forward read of") for a in ps_model.accesses)
        stores = sum(a.startswith("store of") for a in ps_model.accesses)
        backward_reads = sum(a.startswith("backward read of") for a in ps_model.accesses)
        assert stores >= 3
        assert backward_reads == layers - 1  # the first layer's backward needs no parameters (no input gradient)
        calls: list[int] = []
        real_run = worker._run_ops

        def spy_run(ops: Any, stream: int) -> Any:
            calls.append(len(ops))
            return real_run(ops, stream)

        worker._run_ops = spy_run  # type: ignore[method-assign]
        for _ in range(CLOCKS):
            calls.clear()
            loss = ps_model(x).square().mean()
            assert len(calls) <= reads + 1  # a call per read, one for the stores queued at the end
            calls.clear()
            loss.backward()
            assert len(calls) == layers  # a call per layer (its load, and its read but the first layer's)
            ps_model.step()
            reference_step(reference, optimizer, x)
        assert_same_parameters(ps_model, reference)


class SavesMany(nn.Module):
    """A layer whose backward needs several saved tensors: a run of loads."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        hidden = torch.sigmoid(hidden) * torch.tanh(hidden) * hidden.exp().clamp(max=4.0)
        return self.second(hidden)


def test_a_run_of_loads_is_read_back_in_one_engine_call_and_training_matches_torch() -> None:
    torch.manual_seed(0)
    model = SavesMany()
    reference = SavesMany()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    local_access = 4  # mltuner.client._worker.OP_KINDS["local_access"]
    with LocalCluster(1, config()) as cluster:
        worker = cluster.worker(0)
        ps_model = mt.wrap(model, worker, example_input=x, store_activations=True, recompute="none",
                           example_loss=lambda out: out.square().mean())
        kinds = [a.split(" ")[0] for a in ps_model.accesses]
        runs = sum(1 for k, kind in enumerate(kinds) if kind == "load" and (k == 0 or kinds[k - 1] != "load"))
        assert kinds.count("load") >= runs + 3  # runs of several loads, else the test shows nothing
        opened: list[int] = []  # per engine call: the local accesses it opens
        real_run = worker._run_ops

        def spy_run(ops: Any, stream: int) -> Any:
            opened.append(sum(1 for op in ops if op[0] == local_access))
            return real_run(ops, stream)

        worker._run_ops = spy_run  # type: ignore[method-assign]
        for _ in range(CLOCKS):
            opened.clear()
            loss = ps_model(x).square().mean()
            # The saved tensors stored one after another share local accesses
            # (_recording.store_groups): fewer accesses than stores.
            assert 0 < sum(opened) < kinds.count("store")
            opened.clear()
            loss.backward()
            assert len([n for n in opened if n]) == runs  # one engine call per run of loads
            assert 0 < sum(opened) < kinds.count("load")  # ... and a group is read back with one access
            ps_model.step()
            reference_step(reference, optimizer, x)
        assert_same_parameters(ps_model, reference)


class ChangesSaved(nn.Module):
    """Changes tanh's saved output in place before the next layer's read
    (when the queued store's bytes are copied): torch's backward refuses this
    (version counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        hidden.mul_(2)
        return self.second(hidden)


def test_an_activation_changed_in_place_after_it_was_saved_is_refused() -> None:
    torch.manual_seed(0)
    model = ChangesSaved()
    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        copy_model = ChangesSaved()
        copy_model(x).sum().backward()  # torch refuses it too
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=x, store_activations=True, recompute="none",
                           example_loss=lambda out: out.sum())
        with pytest.raises(UnsupportedModelError, match="modified in place after autograd saved it"):
            ps_model(x).sum().backward()
            ps_model.step()


class Watch:
    """Weak references to the storage of each block's output, and which of
    them the last block found alive (None: not watching)."""

    def __init__(self) -> None:
        self.refs: list[Any] | None = None
        self.alive: list[bool] = []


class Watched(nn.Module):
    """A Linear and a tanh whose output (saved by tanh and by the next
    layer) is watched through a weak reference to its storage."""

    def __init__(self, width: int, watch: Watch, last: bool = False) -> None:
        super().__init__()
        self.linear, self.watch, self.last = nn.Linear(width, width), watch, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.linear(x))
        refs = self.watch.refs
        if refs is not None and self.last:
            self.watch.alive = [ref() is not None for ref in refs]
        elif refs is not None:
            refs.append(weakref.ref(out.untyped_storage()))
        return out


def test_stored_activations_are_freed_during_the_forward_and_training_matches_torch() -> None:
    # Each block is a layer: a block's saved output goes to the engine with
    # a later block's read, after which nothing of the adapter's holds it.
    # Under a budget this is what keeps the framework's own memory from
    # holding every activation of the forward at once.
    watch, blocks = Watch(), 6

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(Watched(16, watch, last=k == blocks - 1) for k in range(blocks)))

    model, reference = build(), build()
    x = torch.randn(8, 16)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=x, store_activations=True, recompute="none",
                           example_loss=lambda out: out.square().mean())
        for _ in range(CLOCKS):
            watch.refs = []
            out = ps_model(x)
            watch.refs = None
            assert watch.alive[:2] == [False, False], watch.alive  # gone before the forward ends
            out.square().mean().backward()
            ps_model.step()
            reference_step(reference, optimizer, x)
        assert_same_parameters(ps_model, reference)



def test_store_groups_join_a_run_of_stores_per_table_up_to_the_largest_access() -> None:
    from mltuner.client._layout import TensorLayout
    from mltuner.torch._recording import Event, Slot, Tables, store_groups

    slots = [Slot((256,), torch.float32) for _ in range(6)]  # 1 KiB each
    slots.append(Slot((256,), torch.float16))  # 512 B: joins too (whole float32 words)
    slots.append(Slot((3,), torch.float16))  # 6 B: not whole words, stored alone
    first, second = TensorLayout(64), TensorLayout(64)
    for number in range(len(slots)):
        (second if number == 4 else first).add(f"a{number}", (-(-slots[number].nbytes // 4),))
    tables = Tables([], [(None, first), (None, second)])  # type: ignore[list-item]
    events = [Event("store", slot=0), Event("store", slot=1), Event("store", slot=2), Event("read", 0),
              Event("store", slot=3), Event("store", slot=4), Event("store", slot=5), Event("store", slot=6),
              Event("store", slot=7)]
    # Groups of at most 2 KiB (the largest access); a run ends at the read;
    # slot 4's rows are in the other table.
    assert store_groups(events, slots, tables, largest=2048) == {0: (0, 1), 1: (0, 1), 3: (3, 5), 5: (3, 5)}
    assert store_groups(events, slots, tables, largest=4096) == {
        0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2), 3: (3, 5, 6), 5: (3, 5, 6), 6: (3, 5, 6)}


def test_a_store_through_its_own_engine_call_ends_every_open_group() -> None:
    """A slot the engine cannot copy itself (not whole float32 words, or not
    one dense span: a chunk of a batch) is stored through an engine call of
    its own, which posts what is queued: the groups open then close before
    it, or their later slots' pieces would never reach the engine."""
    from mltuner.client._layout import TensorLayout
    from mltuner.torch._recording import Event, Slot, Tables, store_groups

    dense = Slot((4, 64), torch.float32)
    chunk = Slot((4, 32), torch.float32, stride=(64, 1))  # x.chunk(2, dim=1)[1]: gaps between its rows
    odd = Slot((3,), torch.float16)
    assert dense.exact_layout and not chunk.exact_layout
    slots = [dense, dense, chunk, dense, dense, odd, dense, dense]
    layout = TensorLayout(64)
    for number, slot in enumerate(slots):
        layout.add(f"a{number}", (-(-slot.nbytes // 4),))
    tables = Tables([], [(None, layout)])  # type: ignore[list-item]
    events = [Event("store", slot=number) for number in range(len(slots))]
    assert store_groups(events, slots, tables, largest=1 << 20) == {
        0: (0, 1), 1: (0, 1), 3: (3, 4), 4: (3, 4), 6: (6, 7), 7: (6, 7)}


class ShuffleBlock(nn.Module):
    """ShuffleNet V2's unit in miniature: half the channels pass, the other
    half go through a branch; the branch's first layer saves a chunk of its
    input (no dense span), between saved tensors that are."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        half = channels // 2
        self.branch = nn.Sequential(nn.Conv2d(half, half, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(),
                                    nn.Conv2d(half, half, 3, padding=1, groups=half, bias=False),
                                    nn.BatchNorm2d(half), nn.Conv2d(half, half, 1, bias=False), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, branched = x.chunk(2, dim=1)
        out = torch.cat((kept, self.branch(branched)), dim=1)
        batch, channels, height, width = out.shape
        return out.view(batch, 2, channels // 2, height, width).transpose(1, 2).reshape(batch, channels, height, width)


def test_a_layer_of_blocks_whose_saved_chunks_split_the_groups_trains_as_torch() -> None:
    """Three such blocks as one layer (one table of stored activations):
    each block's chunk is stored through its own engine call in the middle
    of the layer's run of stores. Until stop 46 the groups open there were
    posted without their later slots, whose rows then read back stale bytes:
    torchvision's shufflenet_v2 trained on wrong gradients under a budget."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(*(ShuffleBlock(8) for _ in range(3))),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    model, reference = make(), make()
    x = torch.randn(4, 3, 8, 8)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with LocalCluster(1, config()) as cluster:
        ps_model = mt.wrap(model, cluster.worker(0), example_input=x, store_activations=True, recompute="none",
                           example_loss=lambda out: out.square().mean())
        for _ in range(CLOCKS):
            ps_model(x).square().mean().backward()
            ps_model.step()
            reference_step(reference, optimizer, x)
        assert_same_parameters(ps_model, reference)
