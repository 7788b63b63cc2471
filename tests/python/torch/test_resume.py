"""A wrapped model's checkpoints: ``save_checkpoint`` and
``wrap(resume_from=)``. A run stopped after a checkpoint and resumed from it
ends with the parameters, batch-norm statistics, optimizer state and
learning-rate schedule of the run that never stopped, bit for bit; a
checkpoint of another model or rule is refused before anything changes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402

CLOCKS, SAVED_AT = 10, 4
BATCHES = [(torch.randn(12, 8, generator=torch.Generator().manual_seed(i)),
            torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(100 + i))) for i in range(CLOCKS)]
Optimizers = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizers] = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda m: torch.optim.Adam([{"params": m[0].parameters(), "lr": 0.02},
                                        {"params": list(m[1].parameters()) + list(m[3].parameters())}], lr=0.01),
}


def net() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model[2].requires_grad_(False)  # no parameters: a frozen one below
    model.register_parameter("frozen", nn.Parameter(torch.ones(3), requires_grad=False))
    return model


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    # Writes each group's lr when made: a resumed loop loads the saved groups after it.
    "warmup": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 6)),
}


def train(model: mt.PSModule, scheduler: torch.optim.lr_scheduler.LRScheduler, clocks: range,
          save: Callable[[int], None] | None = None) -> None:
    for clock in clocks:
        x, y = BATCHES[clock]
        nn.functional.cross_entropy(model(x), y).backward()
        model.optimizer.step()
        scheduler.step()
        if save is not None:
            save(clock + 1)


def final_state(model: mt.PSModule) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), "lr": torch.tensor([g["lr"] for g in model.optimizer.param_groups])}


def stop_and_resume(tmp_path: Path, make_optimizer: Optimizers, schedule: str, *,
                    make_net: Callable[[], nn.Module] = net, saved_groups: int | None = None,
                    resumed_groups: int | None = None) -> list[list[str]]:
    """Trains CLOCKS clocks, saving at SAVED_AT, then resumes from there in
    a new job and trains to the end: both end in the same state, bit for
    bit. ``*_groups``: each run's wrap(group_bytes=). Returns each run's
    layers."""
    root = tmp_path / "checkpoints"
    with mltuner.Job() as job:
        module = make_net()
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=make_optimizer(module),
                        group_bytes=saved_groups)
        layers = [model.layers]
        scheduler = SCHEDULERS[schedule](model.optimizer)

        def save(clock: int) -> None:
            if clock == SAVED_AT:
                model.save_checkpoint(root, user_state={"scheduler": scheduler.state_dict(), "clock": clock})

        train(model, scheduler, range(CLOCKS), save)
        want = final_state(model)

    with mltuner.Job() as job:  # a new process would do the same: a fresh module and optimizer
        module = make_net()
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=make_optimizer(module),
                        resume_from=root, group_bytes=resumed_groups)
        layers.append(model.layers)
        assert model.resumed is not None
        assert model.resumed.clock == SAVED_AT and model.resumed.user_state["clock"] == SAVED_AT
        assert model.resumed.path == root / f"clock-{SAVED_AT:08d}"
        scheduler = SCHEDULERS[schedule](model.optimizer)
        model.optimizer.load_state_dict(model.resumed.optimizer)  # the saved lr, over the one made above
        scheduler.load_state_dict(model.resumed.user_state["scheduler"])
        train(model, scheduler, range(SAVED_AT, CLOCKS))
        got = final_state(model)
        assert model.save_checkpoint(root).name == f"clock-{CLOCKS:08d}"  # clocks count on from the checkpoint

    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    return layers


@pytest.mark.parametrize("schedule", SCHEDULERS)
@pytest.mark.parametrize("make_optimizer", OPTIMIZERS.values(), ids=list(OPTIMIZERS))
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path: Path, make_optimizer: Optimizers,
                                                             schedule: str) -> None:
    stop_and_resume(tmp_path, make_optimizer, schedule)


def nested_net() -> nn.Sequential:
    """Blocks that wrap() reads as one layer each by default, and as one
    per module with group_bytes=0."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)), nn.ReLU(),
                         nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)))


# Another device budget or batch per worker makes wrap() group the layers
# into other tables (smaller groups where the memory is short): the resumed
# run's tables are made of the saved ones' pieces, momentum and Adam's
# moments and step count with them.
@pytest.mark.parametrize(("saved_groups", "resumed_groups"), [(0, None), (None, 0)],
                         ids=["saved-apart", "resumed-apart"])
@pytest.mark.parametrize("make_optimizer", [
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda m: torch.optim.Adam([{"params": m[0].parameters(), "lr": 0.02}, {"params": m[2].parameters()}], lr=0.01),
], ids=["sgd-momentum", "adam"])
def test_a_run_resumed_with_its_layers_grouped_otherwise_ends_where_the_uninterrupted_one_does(
        tmp_path: Path, make_optimizer: Optimizers, saved_groups: int | None, resumed_groups: int | None) -> None:
    saved, resumed = stop_and_resume(tmp_path, make_optimizer, "step", make_net=nested_net, saved_groups=saved_groups,
                                     resumed_groups=resumed_groups)
    assert saved != resumed


def test_without_the_optimizer_state_the_run_would_differ(tmp_path: Path) -> None:
    """The reference the test above compares with is sensitive to the
    momentum: restarting from the saved parameters and buffers alone (a
    state_dict loaded before wrap()) ends elsewhere."""
    root = tmp_path / "checkpoints"
    with mltuner.Job() as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module))
        scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=100)
        train(model, scheduler, range(SAVED_AT))
        saved = model.state_dict()
        train(model, scheduler, range(SAVED_AT, CLOCKS))
        want = model.state_dict()
    with mltuner.Job() as job:
        module = net()
        module.load_state_dict(saved)
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module))
        scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=100)
        train(model, scheduler, range(SAVED_AT, CLOCKS))
        assert not torch.equal(model.state_dict()["0.weight"], want["0.weight"])


def _saved(root: Path, module: nn.Module | None = None, optimizer: Optimizers = OPTIMIZERS["sgd-momentum"]) -> Path:
    with mltuner.Job() as job:
        module = module or net()
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=optimizer(module))
        assert model.resumed is None
        with pytest.raises(mltuner.OutOfOrderError, match="finished clock"):
            model.save_checkpoint(root)
        x, y = BATCHES[0]
        nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(mltuner.OutOfOrderError, match="middle of a clock"):
            model.save_checkpoint(root)
        model.step()
        with pytest.raises(mltuner.InvalidArgumentError, match="JSON"):
            model.save_checkpoint(root, user_state={"f": print})
        return model.save_checkpoint(root)


def test_checkpoints_that_do_not_fit_are_refused_before_anything_changes(tmp_path: Path) -> None:
    root = _saved(tmp_path / "sgd")
    with mltuner.Job() as job:
        other = net()
        other[3] = nn.Linear(16, 4)  # the same buffers and frozen parameter, another table
        with pytest.raises(mltuner.InvalidArgumentError, match=r"'3.weight' is \(3, 16\) there, \(4, 16\) here"):
            mt.wrap(other, job.worker, example_input=BATCHES[0][0], resume_from=root)
        without_bn = net()
        without_bn[1] = nn.Identity()
        with pytest.raises(mltuner.InvalidArgumentError, match="'1.running_mean' is only in the checkpoint"):
            mt.wrap(without_bn, job.worker, example_input=BATCHES[0][0], resume_from=root)
        module = net()
        two_groups = torch.optim.SGD([{"params": module[0].parameters()},
                                      {"params": list(module[1].parameters()) + list(module[3].parameters())}],
                                     lr=0.1, momentum=0.9)
        with pytest.raises(mltuner.InvalidArgumentError, match="param groups"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=two_groups, resume_from=root)
        adam = torch.optim.Adam(module.parameters(), lr=0.5)
        with pytest.raises(mltuner.InvalidArgumentError, match="trained with SGD, this wrap.. was given Adam"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=adam, resume_from=root)
        with pytest.raises(mltuner.InvalidArgumentError, match="trained with SGD, this wrap.. was given no optimizer"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], resume_from=root)
        sgd = torch.optim.SGD(module.parameters(), lr=0.5)
        with pytest.raises(mltuner.InvalidArgumentError, match="trainable parameter 'frozen' is only in"):
            module.frozen.requires_grad_(True)  # another model: the saved settings must not stay
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=sgd, resume_from=root)
        module.frozen.requires_grad_(False)
        assert sgd.param_groups[0]["lr"] == 0.5 and sgd.param_groups[0]["momentum"] == 0  # as before the wrap()
        with pytest.raises(mltuner.NotFoundError, match="no complete checkpoint"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], resume_from=tmp_path / "nowhere")
        broken = tmp_path / "broken"
        shutil.copytree(root, broken)
        values = broken / "shard-0" / "table-0.values.npy"
        values.write_bytes(values.read_bytes()[:100])  # a file cut short (a full disk, a copy interrupted)
        with pytest.raises(mltuner.InvalidArgumentError, match="table-0.values.npy cannot be read"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        (broken / "shard-0" / "table-1.state.npy").unlink()
        values.write_bytes((root / "shard-0" / "table-0.values.npy").read_bytes())
        with pytest.raises(mltuner.InvalidArgumentError, match="table-1.state.npy cannot be read"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        shutil.copy(root / "shard-0" / "table-1.state.npy", broken / "shard-0" / "table-1.state.npy")
        flipped = bytearray(values.read_bytes())
        flipped[-1] ^= 0x40  # a value changed on disk: the file reads, its checksum differs
        values.write_bytes(bytes(flipped))
        with pytest.raises(mltuner.InvalidArgumentError, match=r"table-0.values.npy .* is damaged: its CRC-32"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        values.write_bytes((root / "shard-0" / "table-0.values.npy").read_bytes())
        index = broken / "attachments" / "torch-adapter.json"
        content = json.loads(index.read_text())
        content["tables"]["torch:0"]["0.bias"] = 0  # where the weight lies: a resume would take it for the bias
        index.write_text(json.dumps(content))
        with pytest.raises(mltuner.InvalidArgumentError, match="torch-adapter.json is damaged: its CRC-32"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        # Edited with the checksums dropped (as a checkpoint from before them):
        # the index's own checks still name what is wrong.
        manifest = json.loads((broken / "manifest.json").read_text())
        del manifest["attachments_crc32"]
        (broken / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(mltuner.InvalidArgumentError, match="'0.bias' overlaps another parameter of 'torch:0'"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        content = json.loads((root / "attachments" / "torch-adapter.json").read_text())
        content["groups"][0]["lr"] = "abc"  # hand-edited: named with the file, not a bare ValueError later
        index.write_text(json.dumps(content))
        with pytest.raises(mltuner.InvalidArgumentError, match="torch-adapter.json cannot be read: param group 0's 'lr'"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        content = json.loads((root / "attachments" / "torch-adapter.json").read_text())
        tensor = next(entry for entry in content["local"] if entry.get("dtype") == "float32")
        tensor["dtype"] = "float64"  # its bytes no longer fit its shape
        index.write_text(json.dumps(content))
        with pytest.raises(mltuner.InvalidArgumentError, match="torch-adapter.json cannot be read"):
            mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                    resume_from=broken)
        # The worker was left as it was: it can still be wrapped, and resumes.
        module = net()
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                        resume_from=root)
        assert model.resumed is not None and model.resumed.clock == 1 and model.resumed.user_state is None
        x, y = BATCHES[0]
        nn.functional.cross_entropy(model(x), y).backward()
        model.step()
        job.save_checkpoint(tmp_path / "plain")
    with mltuner.Job() as job:
        with pytest.raises(mltuner.NotFoundError, match="Job.save_checkpoint"):
            mt.wrap(net(), job.worker, example_input=BATCHES[0][0], resume_from=tmp_path / "plain")


def test_a_worker_outside_a_job_has_no_checkpoints(tmp_path: Path) -> None:
    root = _saved(tmp_path / "sgd")
    with mltuner.LocalCluster(1) as cluster:
        worker = cluster.worker(0)
        with pytest.raises(mltuner.InvalidArgumentError, match="mltuner.Job"):
            mt.wrap(net(), worker, example_input=BATCHES[0][0], resume_from=root)
        model = mt.wrap(net(), worker, example_input=BATCHES[0][0])
        with pytest.raises(mltuner.InvalidArgumentError, match="mltuner.Job"):
            model.save_checkpoint(tmp_path / "x")


def test_extra_state_and_odd_dtypes_come_back(tmp_path: Path) -> None:
    class Counted(nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 3)
            self.seen = {"batches": 0}
            self.register_buffer("bf16", torch.arange(4, dtype=torch.bfloat16))
            self.register_buffer("flags", torch.tensor([True, False]))

        def get_extra_state(self) -> dict[str, int]:
            return self.seen

        def set_extra_state(self, state: dict[str, int]) -> None:
            self.seen = dict(state)

    module = Counted()
    module.seen["batches"] = 7
    module.bf16.mul_(3)
    root = _saved(tmp_path / "x", module, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5))
    fresh = Counted()
    with mltuner.Job() as job:
        model = mt.wrap(fresh, job.worker, example_input=BATCHES[0][0],
                        optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.5), resume_from=root)
        assert fresh.seen == {"batches": 7}
        assert torch.equal(fresh.bf16, module.bf16) and fresh.bf16.dtype == torch.bfloat16
        assert torch.equal(fresh.flags, module.flags)
        assert model.resumed is not None


def test_the_optimizers_state_dict_round_trip_keeps_the_groups_and_refuses_lost_state() -> None:
    """A loop that checkpoints optimizer.state_dict() as with torch: the
    dict holds the param groups (and says, once, that the servers' momentum
    is not in it); load_state_dict sets the groups' settings, and refuses a
    dict with per-parameter state, which the servers could not take."""
    with mltuner.Job() as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module))
        train(model, torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=100), range(1))
        with pytest.warns(UserWarning, match="not the servers' optimizer state"):
            saved = model.optimizer.state_dict()
        assert saved["state"] == {} and saved["param_groups"][0]["lr"] == 0.1
        model.optimizer.state_dict()  # said once
        saved["param_groups"][0]["lr"] = 0.025
        model.optimizer.load_state_dict(saved)
        assert model.optimizer.param_groups[0]["lr"] == 0.025  # torch's own load would have been lost here
        plain = net()
        torch_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        nn.functional.cross_entropy(plain(BATCHES[0][0]), BATCHES[0][1]).backward()
        torch_optimizer.step()
        with pytest.raises(mltuner.OutOfOrderError, match="resume_from"):
            model.optimizer.load_state_dict(torch_optimizer.state_dict())
        two_groups = {"state": {}, "param_groups": [{"params": [0]}, {"params": [1, 2]}]}
        with pytest.raises(mltuner.InvalidArgumentError, match="param groups"):
            model.optimizer.load_state_dict(two_groups)
        # Another momentum was set, and refused only by the next clock, with the groups changed.
        other = {"state": {}, "param_groups": [{**saved["param_groups"][0], "momentum": 0.5, "lr": 0.5}]}
        with pytest.raises(mltuner.InvalidArgumentError, match=r"\['momentum'\] is 0.5 there, 0.9 here"):
            model.optimizer.load_state_dict(other)
        assert model.optimizer.param_groups[0]["lr"] == 0.025  # nothing was set
        train(model, torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=100), range(1, 2))


def test_a_model_with_a_grad_scaler_resumes(tmp_path: Path) -> None:
    """With a GradScaler the optimizer's groups are the model's alone (the
    scaler once had one of its own there), so the fresh optimizer's groups
    match the checkpoint's."""
    def wrapped(job: mltuner.Job, resume: bool) -> mt.PSModule:
        module = net()
        return mt.wrap(module, job.worker, example_input=BATCHES[0][0], grad_scaler=torch.amp.GradScaler("cpu"),
                       optimizer=OPTIMIZERS["sgd-momentum"](module), resume_from=tmp_path if resume else None)

    with mltuner.Job() as job:
        model = wrapped(job, resume=False)
        train(model, torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=100), range(2))
        assert len(model.optimizer.param_groups) == 1
        model.save_checkpoint(tmp_path)
        want = model.state_dict()
    with mltuner.Job() as job:
        model = wrapped(job, resume=True)
        assert model.resumed is not None and len(model.resumed.optimizer["param_groups"]) == 1
        got = model.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_config_rule_that_keeps_other_state_is_refused(tmp_path: Path) -> None:
    """Without a torch optimizer the servers' rule is the Config's: a
    checkpoint of a rule with momentum does not fit one without."""
    with mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("sgd", 0.1, momentum=0.9))) as job:
        model = mt.wrap(net(), job.worker, example_input=BATCHES[0][0])
        train(model, torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=100), range(1))
        model.save_checkpoint(tmp_path)
    with mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add"))) as job:
        with pytest.raises(mltuner.InvalidArgumentError, match="arrays of optimizer state"):
            mt.wrap(net(), job.worker, example_input=BATCHES[0][0], resume_from=tmp_path)
        model = mt.wrap(net(), job.worker, example_input=BATCHES[0][0])  # the worker is as it was


@pytest.mark.parametrize("given", ["root", "directory"])
def test_resuming_from_a_root_removes_what_an_interrupted_save_left(tmp_path: Path, given: str) -> None:
    # As Job.restore_checkpoint(root) does (docs/distributed.md); the
    # adapter restored the root's newest directory and left them.
    saved = _saved(tmp_path / "root")
    leftovers = [tmp_path / "root" / ".clock-00000009.tmp" / "shard-0", tmp_path / "root" / "latest.tmp"]
    leftovers[0].mkdir(parents=True)
    leftovers[1].write_text("half")
    module = net()
    with mltuner.Job() as job:
        mt.wrap(module, job.worker, example_input=BATCHES[0][0], optimizer=OPTIMIZERS["sgd-momentum"](module),
                resume_from=tmp_path / "root" if given == "root" else saved)
    names = sorted(entry.name for entry in (tmp_path / "root").iterdir() if entry.name != ".writer.lock")
    if given == "root":
        assert names == [saved.name, "latest"]
    else:  # a checkpoint directory named by hand: its root is left as it is
        assert names == [".clock-00000009.tmp", saved.name, "latest", "latest.tmp"]
