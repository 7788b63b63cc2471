"""Bad input to the adapter gets a Python exception naming the problem,
never a hang, a crash or silently wrong training.

Three kinds: models the adapter refuses at wrap() (UnsupportedModelError),
training loops that call things out of order (OutOfOrderError; the clock can
go on once the loop does the right thing), and clocks that differ from the
recorded one (IterationMismatchError; the model cannot continue, and says
so). Waits are bounded by Config.wait_timeout_s.
"""

from __future__ import annotations

import copy

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner import Config, LocalCluster, UpdateRule, Worker  # noqa: E402

X = torch.randn(4, 6)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture(name="worker")
def worker_fixture() -> Iterator[Worker]:
    config = Config(wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=0.1))
    with LocalCluster(1, config) as cluster:
        yield cluster.worker(0)


def one_clock(ps_model: mt.PSModule, x: torch.Tensor = X) -> None:
    ps_model(x).square().mean().backward()
    ps_model.step()


# -- models the adapter refuses ---------------------------------------------------------


class UsesChildWeight(nn.Module):
    """Reads a child's parameter without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(self.first(x)), self.second.weight, self.second.bias)


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 3)
        self.spare = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class ReturnsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale  # a view of the parameter's own buffer


def compiled() -> nn.Module:
    return torch.compile(mlp(), backend="eager")  # type: ignore[return-value]


def compiled_forward() -> nn.Module:
    model = mlp()
    model.forward = torch.compile(model.forward, backend="eager")  # type: ignore[method-assign]
    return model


def compiled_in_place() -> nn.Module:
    model = mlp()
    model.compile(backend="eager")
    return model


def scripted() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated in recent torch
        return torch.jit.script(mlp())  # type: ignore[no-any-return]


REFUSED: list[tuple[str, Callable[[], nn.Module], Any, str]] = [
    ("float64", lambda: mlp().double(), X.double(), r"'0\.weight' has dtype torch\.float64.*float32"),
    ("sparse embedding", lambda: nn.Embedding(10, 6, sparse=True), torch.randint(0, 10, (4,)), "sparse=True"),
    ("torch.compile", compiled, X, "torch.compile"),
    ("torch.compile of the forward", compiled_forward, X, r"the forward of the model is compiled with torch\.compile"),
    ("nn.Module.compile", compiled_in_place, X, r"the model is compiled with \.compile\(\)"),
    ("TorchScript", scripted, X, "TorchScript"),
    ("DataParallel", lambda: nn.DataParallel(mlp()), X, "DataParallel"),
    ("no trainable parameters", lambda: mlp().requires_grad_(False), X, "no trainable parameters"),
    ("unused layer", Unused, X, r"'spare' has trainable parameters but did not run"),
    ("parameter used outside its module", UsesChildWeight, X, r"parameter \('second\.weight'\) is used outside the forward"),
    ("layer returning its parameter", ReturnsWeight, X, "returns a view of its own parameters"),
]


@pytest.mark.parametrize(("maker", "example", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_unsupported_models_are_refused_at_wrap(worker: Worker, maker: Callable[[], nn.Module], example: Any,
                                                message: str) -> None:
    model = maker()
    with pytest.raises(mt.UnsupportedModelError, match=message):
        mt.wrap(model, worker, example_input=example)
    assert isinstance(mt.UnsupportedModelError("x"), mltuner.InvalidArgumentError)


def test_a_lazy_module_that_has_not_run_is_refused_at_wrap(worker: Worker) -> None:
    """Its parameters have no shape until its first forward pass, so there
    is nothing to lay out in a table: refused up front, saying what to do
    (not torch's "uninitialized parameter" from inside the adapter)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LazyLinear(3))
    with pytest.raises(mt.UnsupportedModelError, match=r"module '2' \(LazyLinear\) has uninitialized parameters or "
                                                       r"buffers \(weight, bias\).*run one forward pass before wrap"):
        mt.wrap(model, worker, example_input=X)
    model(X)  # as the message says: now it wraps (the refusal left the worker fresh) and trains
    one_clock(mt.wrap(model, worker, example_input=X))


def test_used_under_no_grad_is_named() -> None:
    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                x = self.a(x)
            return self.b(x)

    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        with pytest.raises(mt.UnsupportedModelError, match=r"'a\.weight', 'a\.bias' got no gradient"):
            mt.wrap(Frozen(), cluster.worker(0), example_input=X)


def test_bad_arguments(worker: Worker) -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        mt.wrap("not a model", worker, example_input=X)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mltuner.Worker"):
        mt.wrap(mlp(), object(), example_input=X)  # type: ignore[arg-type]
    with pytest.raises(mltuner.InvalidArgumentError, match="slack"):
        mt.wrap(mlp(), worker, example_input=X, slack=-1)
    with pytest.raises(mltuner.InvalidArgumentError, match="scalar"):
        mt.wrap(mlp(), worker, example_input=X, example_loss=lambda out: out)
    worker.create_table("mine", 2, 2)
    with pytest.raises(mltuner.InvalidArgumentError, match="fresh worker"):
        mt.wrap(mlp(), worker, example_input=X)


# -- calls out of order --------------------------------------------------------------------


def test_calls_out_of_order_raise_and_the_clock_recovers(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X)
    with pytest.raises(mltuner.OutOfOrderError, match="without a forward pass"):
        ps_model.step()

    loss = ps_model(X).square().mean()
    with pytest.raises(mltuner.OutOfOrderError, match=r"no gradient yet for layer\(s\) '0', '2'"):
        ps_model.step()  # step without backward
    loss.backward()
    ps_model.step()

    loss = ps_model(X).square().mean()
    loss.backward(retain_graph=True)
    with pytest.raises(mltuner.OutOfOrderError, match="second backward pass|second gradient"):
        loss.backward(retain_graph=True)  # backward twice in one clock
    ps_model.step()
    with pytest.raises(mltuner.OutOfOrderError, match="outside clock 2's backward pass"):
        loss.backward()  # a stale graph after step
    one_clock(ps_model)  # the model goes on training
    assert ps_model.clock == 3

    with pytest.raises(mltuner.OutOfOrderError, match="outside a forward pass of the wrapped model"):
        ps_model.module(X)  # the original module, bypassing the adapter
    with pytest.raises(mltuner.OutOfOrderError, match="before wrap"):
        ps_model.to(torch.float64)
    with pytest.raises(mltuner.OutOfOrderError, match="before wrap"):
        ps_model.load_state_dict({})
    one_clock(ps_model)
    assert ps_model.clock == 4


def test_backward_twice_without_retained_graph_is_torchs_error(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X, store_activations=True)
    loss = ps_model(X).square().mean()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    ps_model.step()
    one_clock(ps_model)


# -- clocks that differ from the recording -------------------------------------------------------


def test_a_batch_larger_than_recorded_with_stored_activations_is_a_clear_error(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X[:3], store_activations=True)
    one_clock(ps_model, X[:3])
    one_clock(ps_model, X[:2])  # smaller: its rows hold it
    with pytest.raises(mt.IterationMismatchError,
                       match=r"inputs are \[\(4, 6\)\], example_input's \[\(3, 6\)\].*no input may be larger"):
        ps_model(X)
    one_clock(ps_model, X[:3])  # refused before the clock started: it goes on
    assert ps_model.clock == 3


@pytest.mark.parametrize("view", [lambda x: torch.randn(4, 8)[:, :6], lambda x: x.t().contiguous().t()],
                         ids=["slice with gaps", "transposed"])
def test_an_input_of_another_memory_layout_with_stored_activations_is_refused_before_the_clock(
        worker: Worker, view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X, store_activations=True)
    one_clock(ps_model)
    strided = view(X)
    assert strided.shape == X.shape and not strided.is_contiguous()
    with pytest.raises(mt.IterationMismatchError, match=r"input tensor #0 \(4, 6\) has strides .*another memory "
                                                        r"layout than example_input's.*nothing of this clock was done"):
        ps_model(strided)  # it used to fail at a saved tensor, the clock half done
    one_clock(ps_model, strided.contiguous())  # the loop goes on
    assert ps_model.clock == 2


def test_a_saved_tensor_larger_than_recorded_is_a_clear_error(worker: Worker) -> None:
    class Repeat(nn.Module):  # the input keeps its shape, an activation grows
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 3)
            self.times = 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.repeat(self.times, 1))

    model = Repeat()
    ps_model = mt.wrap(model, worker, example_input=X, store_activations=True)
    one_clock(ps_model)
    model.times = 2
    with pytest.raises(mt.IterationMismatchError,
                       match=r"\(8, 6\).*recorded one \(4, 6\).*not larger ones: give wrap\(\) the largest"):
        ps_model(X)
    with pytest.raises(mltuner.OutOfOrderError, match="earlier error left clock 1 incomplete"):
        ps_model(X)


@pytest.mark.parametrize("overlap", [True, False], ids=["updates-in-backward", "updates-at-step"])
def test_skipping_a_layer_is_a_clear_error(worker: Worker, overlap: bool) -> None:
    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 3)
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x if self.skip else self.a(x))

    model = Optional()
    ps_model = mt.wrap(model, worker, example_input=X, overlap_updates=overlap)
    one_clock(ps_model)
    model.skip = True
    if overlap:  # the layer hooks check every read against the recording
        with pytest.raises(mt.IterationMismatchError, match="forward read of layer 'b'.*forward read of layer 'a'"):
            ps_model(X)
    else:  # the forward binds every layer up front, hook-free: step() finds the gradient missing
        ps_model(X).square().mean().backward()
        with pytest.raises(mt.IterationMismatchError, match="'a.weight' got no gradient.*module 'a' did not run"):
            ps_model.step()
    with pytest.raises(mltuner.OutOfOrderError, match="earlier error left clock 1 incomplete"):
        ps_model(X)


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "a compiled step"])
def test_the_wrapped_model_under_torch_compile_is_refused_and_trains_on(worker: Worker, how: str) -> None:
    """Dynamo cannot trace the adapter's engine calls: called under
    torch.compile, the wrapped model refuses before a clock starts (no
    internal error from inside dynamo, no clock left half done)."""
    ps_model = mt.wrap(mlp(), worker, example_input=X)
    one_clock(ps_model)

    def call() -> None:
        if how == "torch.compile(model)":
            torch.compile(ps_model, backend="eager")(X)
        elif how == "model.compile()":
            ps_model.compile(backend="eager")
        else:
            torch.compile(lambda x: ps_model(x).square().mean(), backend="eager")(X)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own notes on the frames it skips
        with pytest.raises(mt.UnsupportedModelError, match="cannot run under torch.compile.*Compile the parts"):
            call()
    one_clock(ps_model)  # the model goes on


@pytest.mark.parametrize("overlap", [False, True])
def test_a_layer_cut_off_from_the_loss_is_refused_whatever_the_shipping(worker: Worker, overlap: bool) -> None:
    """A layer whose output no longer reaches the loss (detached) gets no
    gradient although the backward pass finished: an IterationMismatchError
    naming it, also where the other layers' updates left in the backward
    pass (not a clock ended with zeros for it, as after an exception)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    ps_model = mt.wrap(model, worker, example_input=X, overlap_updates=overlap)
    one_clock(ps_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "left half done" warning
        model[1].register_forward_hook(lambda module, args, out: out.detach())
        ps_model(X).square().mean().backward()
        match = ("the backward pass finished without a gradient for layer.s. '0'" if overlap
                 else "'0.weight' got no gradient")
        with pytest.raises(mt.IterationMismatchError, match=match):
            ps_model.step()


def test_zero_grad_between_backward_and_step_is_named_and_the_clock_goes_on(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X)
    ps_model(X).square().mean().backward()
    with pytest.warns(UserWarning, match=r"zero_grad\(\) dropped the gradients of 1 finished backward pass"):
        ps_model.optimizer.zero_grad()
    with pytest.raises(mltuner.OutOfOrderError, match="found no gradients although its backward pass ran: "
                                                      r"zero_grad\(\) between backward\(\) and step\(\)"):
        ps_model.step()
    ps_model(X).square().mean().backward()  # as the message says: the clock's backward pass again
    ps_model.step()


def test_zero_grad_after_updates_left_in_the_backward_pass_warns(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X, overlap_updates=True)
    ps_model(X).square().mean().backward()
    with pytest.warns(UserWarning, match=r"zero_grad\(\) after the backward pass of clock 0: the updates of 2 "
                                         "layer.s. had already left and apply"):
        ps_model.optimizer.zero_grad()
    ps_model.step()


# -- every wait is bounded ------------------------------------------------------------------


def test_a_missing_worker_gives_a_timeout_not_a_hang(run_workers: Callable[..., list[Any]]) -> None:
    """Worker 1 wraps its model and then stops; under BSP worker 0's second
    clock waits for worker 1's first update, and gives up after
    wait_timeout_s with WaitTimeoutError."""
    config = Config(wait_timeout_s=1.0, update_rule=UpdateRule("sgd", learning_rate=0.1))
    models = [mlp(), mlp()]

    def trainer(worker: Worker) -> float:
        ps_model = mt.wrap(models[0], worker, example_input=X)
        one_clock(ps_model)
        start = time.monotonic()
        with pytest.raises(mltuner.WaitTimeoutError):
            one_clock(ps_model)
        return time.monotonic() - start

    def idler(worker: Worker) -> None:
        mt.wrap(models[1], worker, example_input=X)

    with LocalCluster(2, config) as cluster:
        waited, _ = run_workers([trainer, idler], cluster.workers, on_error=cluster.shutdown)
    assert 0.9 < waited < 10


def test_wrap_waits_for_every_worker_with_a_timeout() -> None:
    """wrap() meets the other workers at the end of the virtual iteration;
    one that never comes makes it fail after wait_timeout_s, and the module
    is given back unchanged."""
    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with LocalCluster(2, Config(wait_timeout_s=1.0)) as cluster:
        start = time.monotonic()
        with pytest.raises(mltuner.WaitTimeoutError, match="every worker"):
            mt.wrap(model, cluster.worker(0), example_input=X)
        assert time.monotonic() - start < 10
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name


def test_an_evaluation_after_updates_left_in_the_backward_pass_is_refused_until_step(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X, store_activations=True)
    ps_model(X).square().mean().backward()  # stored activations: the updates leave during backward()
    with torch.no_grad():
        with pytest.raises(mltuner.OutOfOrderError, match="between backward\\(\\) and step\\(\\) of clock 0.*after step"):
            ps_model(X)
    ps_model.step()
    with torch.no_grad():
        assert ps_model(X).shape == (4, 3)
    one_clock(ps_model)



class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.tanh(self.linear(x))
        return out if mask is None else out * mask


def test_keyword_tensors_are_recorded_from_example_kwargs(worker: Worker) -> None:
    masks = (torch.rand(4, 3, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    reference = Masked()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        reference(X, mask=masks).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    ps_model = mt.wrap(Masked(), worker, example_input=X, example_kwargs={"mask": masks}, store_activations=True)
    with pytest.raises(mt.IterationMismatchError, match="forward got 1 tensors, example_input and example_kwargs 2"):
        ps_model(X)  # without the mask: not the recorded call
    for _ in range(3):
        ps_model(X, mask=masks).square().mean().backward()
        ps_model.step()
    for name, value in reference.state_dict().items():
        assert torch.allclose(ps_model.state_dict()[name], value, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("store", [False, True], ids=["held", "stored"])
def test_a_layer_frozen_after_wrap_is_named(worker: Worker, store: bool) -> None:
    model = mlp()
    ps_model = mt.wrap(model, worker, example_input=X, store_activations=store)
    model[0].requires_grad_(False)
    with pytest.raises(mt.IterationMismatchError, match=r"'0\.weight', '0\.bias' were frozen after wrap\(\)"):
        one_clock(ps_model)


@pytest.mark.parametrize("store", [False, True], ids=["held", "stored"])
def test_a_layer_unfrozen_after_wrap_is_refused_before_the_clock(worker: Worker, store: bool) -> None:
    """Fine-tuning's "train the head, then unfreeze": the parameters frozen
    at wrap() stay local, so unfrozen later they never trained, silently."""
    model = mlp()
    model[0].requires_grad_(False)
    ps_model = mt.wrap(model, worker, example_input=X, store_activations=store)
    one_clock(ps_model)
    model[0].requires_grad_(True)
    with pytest.raises(mt.UnsupportedModelError, match=r"'0\.weight', '0\.bias' were frozen when wrap\(\) took"):
        one_clock(ps_model)
    model[0].requires_grad_(False)  # nothing of the refused clock was done: the loop goes on
    one_clock(ps_model)


@pytest.mark.parametrize("reads", [{}, {"overlap_updates": True}, {"hold_reads": False}, {"store_activations": True}],
                         ids=["updates-at-step", "updates-in-backward", "per-layer", "stored"])
@pytest.mark.parametrize("replaced", ["module", "parameter"])
def test_a_module_replaced_after_wrap_is_named(worker: Worker, reads: dict[str, Any], replaced: str) -> None:
    """Fine-tuning's "a new head": the servers hold the old one's
    parameters, and each way of reading layers noticed at another point (a
    gradient missing, a read not made, an IndexError from a saved tensor
    past the recorded ones), blaming a module that did not run."""
    model = mlp()
    ps_model = mt.wrap(model, worker, example_input=X, **reads)
    one_clock(ps_model)
    if replaced == "parameter":  # seen in its module before the clock starts: the model goes on once it is back
        wrapped = model[2].weight
        model[2].weight = nn.Parameter(torch.randn(3, 8))
        with pytest.raises(mt.UnsupportedModelError, match=r"parameter '2\.weight' of the wrapped model is not the "
                                                           r"one wrap\(\) took.*replaced by a new nn\.Parameter"):
            one_clock(ps_model)
        model[2]._parameters["weight"] = wrapped  # as functional_call puts it back (setattr would re-register it)
        one_clock(ps_model)
        return
    model[2] = nn.Linear(8, 3)
    with pytest.raises(mt.UnsupportedModelError, match=r"module '2' of the wrapped model was replaced or removed after "
                                                       r"wrap\(\).*unwrap\(\) and wrap the module"):
        one_clock(ps_model)
    with pytest.raises(mltuner.OutOfOrderError, match="earlier error left clock 1 incomplete.*replaced"):
        one_clock(ps_model)


@pytest.mark.parametrize("wrap_args", [{}, {"overlap_updates": True}, {"store_activations": True}],
                         ids=["held reads", "shipped from backward", "stored activations"])
def test_a_parameter_swapped_for_the_call_by_functional_call_is_refused_before_the_clock(
        worker: Worker, wrap_args: dict[str, Any]) -> None:
    """torch.func.functional_call puts other tensors in the parameters'
    places for the call only: no new head, as the replaced-module message
    would say, but weights the adapter cannot follow. Refused before the
    clock starts, in every mode (with held reads the layers' hooks are off
    during the forward, and fast weights computed from the NaN placeholders
    trained the servers to NaN), so the model goes on."""
    model = mlp()
    ps_model = mt.wrap(model, worker, example_input=X, **wrap_args)
    one_clock(ps_model)
    fast = {name: param * 0.9 for name, param in ps_model.named_parameters()}  # MAML's fast weights, say
    with pytest.raises(mt.UnsupportedModelError, match=r"parameter '0\.weight' of the wrapped model is not the one "
                                                       r"wrap\(\) took: swapped for another tensor for this call "
                                                       r"\(torch\.func\.functional_call.*own parameters.*goes on"):
        torch.func.functional_call(ps_model, fast, (X,)).square().mean().backward()
    assert model[0].weight is ps_model.module[0].weight  # functional_call put the parameters back
    one_clock(ps_model)
    state = ps_model.state_dict()
    assert all(torch.isfinite(value).all() for value in state.values())


class DataDependent(nn.Module):
    """Saves other tensors when ``other``: as packed sequences or top-k routing would."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.other = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.exp(h.sum(1) if self.other else h)  # exp saves its output


def test_saved_tensors_that_depend_on_the_data_are_named_so(worker: Worker) -> None:
    model = DataDependent()
    ps_model = mt.wrap(model, worker, example_input=X, store_activations=True)
    model.other = True
    # Smaller, but of another rank: not a case for a larger example_input.
    with pytest.raises(mt.IterationMismatchError, match=r"is \(4,\) torch.float32, the recorded one \(4, 6\).*"
                                                        r"saved other tensors than the recording pass did"):
        one_clock(ps_model)


def test_gradients_from_autograd_grad_are_named_with_stored_activations(worker: Worker) -> None:
    ps_model = mt.wrap(mlp(), worker, example_input=X, store_activations=True)
    loss = ps_model(X).square().mean()
    with pytest.raises(mt.IterationMismatchError, match=r"gradients of layer '2' never reached \.grad.*"
                                                        r"torch\.autograd\.grad.*through loss\.backward\(\)"):
        torch.autograd.grad(loss, list(ps_model.parameters()))


def test_sync_batch_norm_on_several_workers_is_refused() -> None:
    """Without torch.distributed, SyncBatchNorm normalises each worker's batch
    alone: on two workers that trained silently unlike SyncBatchNorm under
    DDP (13% off in a probe). One worker is plain torch's single process."""
    model = nn.Sequential(nn.Linear(6, 8), nn.SyncBatchNorm(8), nn.Linear(8, 3))
    with LocalCluster(2, Config(wait_timeout_s=10)) as cluster:
        with pytest.raises(mt.UnsupportedModelError, match=r"module '1' is nn\.SyncBatchNorm on a job of 2 workers"):
            mt.wrap(model, cluster.worker(0), example_input=X)
    with LocalCluster(1, Config(wait_timeout_s=10)) as cluster:
        one_clock(mt.wrap(model, cluster.worker(0), example_input=X))


@pytest.mark.parametrize("wrap_args", [{}, {"store_activations": True}], ids=["held reads", "stored activations"])
def test_a_backward_pass_with_create_graph_is_refused_as_such(worker: Worker, wrap_args: dict[str, Any]) -> None:
    """A gradient penalty differentiates a backward pass again, which a clock
    cannot: refused naming create_graph (it was called a second backward
    pass, or gradients that never reached .grad)."""
    ps_model = mt.wrap(mlp(), worker, example_input=X, **wrap_args)
    x = X.clone().requires_grad_(True)
    out = ps_model(x)
    with pytest.raises(mt.UnsupportedModelError, match=r"backward pass with create_graph=True .* gradient penalty"):
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.square().mean() + grad.square().sum()).backward()


def test_a_backward_pass_into_an_earlier_clocks_graph_names_detach(worker: Worker) -> None:
    """Truncated backpropagation through time without h.detach(): the second
    clock's loss reaches the first clock's graph (it was blamed on a second
    backward pass). With stored activations the first clock's graph is freed
    (torch says so) unless retained, and a retained one makes the layer save
    its weight, which the recording did not: a mismatch at that read."""
    torch.manual_seed(0)
    cell = nn.Linear(6, 6)
    ps_model = mt.wrap(cell, worker, example_input=X)
    h = torch.tanh(ps_model(X))
    h.square().mean().backward(retain_graph=True)
    ps_model.step()
    with pytest.raises(mltuner.OutOfOrderError, match=r"reached the graph of an earlier forward pass.*h\.detach\(\)"):
        torch.tanh(ps_model(h)).square().mean().backward()


def test_a_hook_registered_after_wrap_that_reads_a_shipped_gradient_is_named(worker: Worker) -> None:
    """A post-accumulate hook of the loop's own runs after the adapter's, once
    the update left: the error says to register it before wrap() (it blamed
    clip_grad_norm_ between backward() and step())."""
    model = mlp()
    ps_model = mt.wrap(model, worker, example_input=X, overlap_updates=True)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: p.grad.norm())  # type: ignore[union-attr]
    with pytest.raises(mltuner.OutOfOrderError, match=r"during backward\(\), by a hook .* register the hook before "
                                                      r"wrap\(\)"):
        ps_model(X).square().mean().backward()


def test_a_parameter_written_between_the_passes_of_a_clock_is_named_so(worker: Worker) -> None:
    """SAM perturbs the weights between its two passes: refused as a write
    between passes (it was called a write during the forward pass)."""
    model = mlp()
    ps_model = mt.wrap(model, worker, example_input=X)
    ps_model(X).square().mean().backward()
    with torch.no_grad():
        model[0].weight.add_(0.01)
    with pytest.raises(mt.UnsupportedModelError, match=r"'0\.weight' was written in place between the backward pass "
                                                       r"and the next forward pass"):
        ps_model(X)


def test_a_loop_that_updates_the_parameters_itself_is_refused_not_left_untrained(worker: Worker) -> None:
    """pytorch/examples' word_language_model steps with p.data.add_(p.grad,
    alpha=-lr) and no optimizer: wrapped, each pass accumulated into clock 0
    and the servers never trained (its losses even matched plain PyTorch,
    through the held reads). One batch dropped by zero_grad() is a skip and
    warns; a clock that keeps dropping them is refused."""
    ps_model = mt.wrap(mlp(), worker, example_input=X)

    def manual_step() -> None:
        ps_model.zero_grad()
        ps_model(X).square().mean().backward()
        for param in ps_model.parameters():
            param.data.add_(param.grad, alpha=-0.1)  # type: ignore[arg-type]

    manual_step()
    with pytest.warns(UserWarning, match=r"dropped the gradients of 1 finished backward pass\(es\) and no step\(\)"
                                         r" has ended a clock since wrap\(\)") as caught:
        manual_step()
    assert caught[0].filename == __file__  # the loop's line, not the adapter's
    with pytest.raises(mltuner.OutOfOrderError, match=r"3 finished backward pass\(es\) and no step\(\).*"
                                                      r"give wrap\(\) a torch\.optim\.SGD"):
        manual_step()
        manual_step()


def test_batches_skipped_by_zero_grad_train_as_plain_pytorch(worker: Worker) -> None:
    """A loop that drops batches' gradients (losses it does not trust),
    three in a row, and steps the next: the servers get the stepped batches'
    updates only, with no warning once a step() has ended a clock (a GAN's
    generator pass through the discriminator is dropped so every
    iteration)."""
    torch.manual_seed(0)
    plain = mlp()
    model = copy.deepcopy(plain)
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ps_model = mt.wrap(model, worker, example_input=X)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step, x in enumerate(xs):
        for loop_model, opt in ((plain, optimizer), (ps_model, ps_model.optimizer)):
            opt.zero_grad(set_to_none=False)
            loop_model(x).square().mean().backward()
            if step not in (1, 2, 3):
                opt.step()
    got = ps_model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name], value)
