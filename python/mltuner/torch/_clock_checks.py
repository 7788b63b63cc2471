"""The checks that refuse what a training loop may not do to a wrapped
model, each before it could confuse the engine: a clock whose events leave
the recorded order (:meth:`ClockChecks._next`, which says the likely
cause), a module or parameter replaced, frozen or unfrozen after wrap(), a
write to the parameters between clocks or in the forward pass, another
autocast or other inputs than the recording's, and ``load_state_dict`` on
the module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mltuner.exceptions import OutOfOrderError
from mltuner.torch._buffers import autocast_state, placeholder
from mltuner.torch._driver_state import DriverState, Phase
from mltuner.torch._errors import IterationMismatchError, UnsupportedModelError
from mltuner.torch._inputs import input_layouts, input_shapes, same_layouts, tensors_in
from mltuner.torch._recording import Event, describe

__all__ = ["ClockChecks"]


def _module_at(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule of ``model`` at qualified ``name``, or None."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _parameter_at(model: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter of ``model`` at qualified ``name``, or None."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


class ClockChecks(DriverState):
    """The refusals of a clock driver (module docstring)."""

    # -- between clocks -----------------------------------------------------------------
    def _refuse_load(self, module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """model.module.load_state_dict(): refused where it would write a
        trainable parameter (a buffers-only state may load)."""
        names = {prefix + slot.name for layer in self.layers for slot in layer.params}
        if not self._closed and names.intersection(state):
            raise OutOfOrderError(
                "load_state_dict on a wrapped model's module: the servers hold the parameters; load the state "
                "into the module before wrap() (worker 0's values become the servers' initial values), or "
                "resume from a checkpoint with wrap(..., resume_from=...)"
            )

    def note_idle_versions(self) -> None:
        """The adapter lets go of the parameters: their version counters now
        (the comment on ``_idle_versions`` in ``_driver_state.py``)."""
        self._idle_versions = [layer.versions() for layer in self.layers]

    def _check_autocast(self) -> None:
        """Refuses a training forward under another autocast than the
        recording's where layers are read in their own forward: autocast
        saves cast copies of the weights (and activations of its dtype)
        instead of what the recording saw, so the backward pass would leave
        the recorded order in the middle of the clock."""
        if self._light:
            return
        now = autocast_state(self.device)
        if now != self._recorded_autocast:
            def words(state: tuple[bool, torch.dtype | None]) -> str:
                return f"under {self.device.type} autocast to {state[1]}" if state[0] else "without autocast"

            raise IterationMismatchError(
                f"clock {self.clock} runs {words(now)}, but wrap() recorded the clock "
                f"{words(self._recorded_autocast)}; where layers are read in their own forward ({self.hold_choice}), "
                "call wrap() inside the same autocast (torch.autocast) as the training loop; nothing of this clock "
                "was done"
            )

    def _check_scheduled(self) -> None:
        """With branches, a clock that no branch will run (none scheduled,
        no trained branch to go on from) is refused before it starts, so
        the model can go on once one is scheduled."""
        if self._branches and self.worker.next_branch is None:
            raise OutOfOrderError(
                f"clock {self.clock} of the wrapped model is not scheduled on any branch: with "
                "Config(branches=True) each clock runs on a branch a tuning session or "
                "job.worker.schedule_branch(branch, clocks) chose, and after a session on the branch it kept; "
                "call schedule_branch first (no session has run since wrap() or a resume, or one's loop left "
                "early, or its driver freed its branches)")

    def _refuse_unfrozen(self) -> None:
        """Refuses a training forward after a parameter frozen at wrap() was
        made trainable (fine-tuning's "unfreeze the backbone"): the servers
        hold only the parameters wrap() found trainable, and autograd would
        pile its gradients up in .grad while the servers never update it."""
        unfrozen = [name for name, param in self._frozen if param.requires_grad]
        if unfrozen:
            raise UnsupportedModelError(
                f"parameter(s) {', '.join(repr(n) for n in unfrozen[:4])}{' ...' if len(unfrozen) > 4 else ''} "
                "were frozen when wrap() took the model and are trainable now (requires_grad_(True) after wrap()); "
                "the servers train only the parameters wrap() found trainable, so these would never change. To "
                "train them later, wrap them trainable in a param group of their own whose lr is 0 until then, or "
                "unwrap() and wrap the module on a new job's worker; nothing of this clock was done"
            )

    def _refuse_writes_between_clocks(self) -> None:
        """Raises OutOfOrderError where the loop changed a parameter in place
        since the adapter last let go of them: the write is lost (the
        servers hold the parameters), and one into the NaN placeholder that
        parameters point at between clocks would hide later misuse. The
        parameters are as before afterwards, so the loop can go on."""
        if self._idle_versions is None:
            return
        for layer, versions in zip(self.layers, self._idle_versions):
            name = layer.changed_since(versions)
            if name is None:
                continue
            with torch.no_grad():
                placeholder(self.device).fill_(float("nan"))
            self._eval_clock, self._eval_copies = None, []  # an evaluation's copies may hold the write
            self.note_idle_versions()
            raise OutOfOrderError(
                f"parameter {name!r} of the wrapped model was changed in place between clocks (model.module."
                "load_state_dict, an initialiser applied after wrap(), p.clamp_() as in WGAN's weight "
                "clipping, ...): the servers hold the parameters and change them only by the update rule, so "
                "the change was dropped. Initialise or load the module before wrap(), or resume with "
                "wrap(..., resume_from=...)"
            )

    def _refuse_writes_to_evaluation_copies(self) -> None:
        """At the clock after an evaluation: raises OutOfOrderError where the
        loop wrote the copies of the servers' values it bound (through
        ``p.data``, which no version counter sees; their sums differ); the
        write is lost either way. One host sync, only after an evaluation.
        The sums are compared bit for bit, so that a NaN the training put in
        the servers' values (a corrupt sample) equals itself, as the same
        sum of the same values always gives the same bits."""
        copies, sums = self._eval_copies, self._eval_sums
        self._eval_copies, self._eval_sums = [], None
        if not copies or sums is None:
            return
        now = torch.stack([flat.sum(dtype=torch.float64) for flat in copies]).view(torch.int64)
        then = sums.view(torch.int64)
        if torch.equal(now, then):
            return
        changed = int(torch.nonzero(now != then)[0, 0])
        raise OutOfOrderError(
            f"the parameters of layer {self.layers[changed].name!r} were changed after an evaluation (through "
            "p.data, say p.data.clamp_() as in WGAN's weight clipping): they held a copy of the servers' values, "
            "which change only by the update rule, so the change was dropped. Initialise or load the module "
            "before wrap(), or resume with wrap(..., resume_from=...)"
        )

    def check_between_clocks(self, what: str) -> None:
        self.check_usable(recover=True)
        if self._phase is not Phase.IDLE:
            raise OutOfOrderError(f"{what} in the middle of a clock: call step() first")
        self._refuse_writes_between_clocks()

    # -- the recorded order ---------------------------------------------------------------
    def _describe(self, event: Event) -> str:
        return describe(event, self.layers, self._acts.slots)

    def _next(self, kind: str, layer: int = -1, slot: int = -1) -> int:
        """Logs the event (recording) or checks that it is the next recorded
        one; returns its index. Takes the event's fields, not an
        :class:`Event`, which would be made only to be compared."""
        events = self._events
        if self._recording:
            events.append(Event(kind, layer, slot))  # type: ignore[arg-type]
            return len(events) - 1
        index = self._cursor
        if index < len(events):
            expected = events[index]
            if expected.kind == kind and expected.layer == layer and expected.slot == slot:
                self._cursor = index + 1
                return index
        self._refuse_replaced()
        event = Event(kind, layer, slot)  # type: ignore[arg-type]
        described = self._describe(events[index]) if index < len(events) else "the end of the clock"
        raise IterationMismatchError(
            f"clock {self.clock}: the model did a {self._describe(event)} where the recorded iteration has "
            f"a {described}; every clock must run the same layers in the same order as the recording "
            f"pass of wrap(){self._mismatch_cause(events[index] if index < len(events) else None)}"
        )

    def _refuse_replaced(self) -> None:
        """Where a clock left the recorded one: raises UnsupportedModelError,
        and the model can train no further, if a module or parameter of the
        layers is no longer where wrap() found it, the likely cause: replaced
        for good, or swapped for one call (``torch.func.functional_call``)."""
        replaced = self._replaced()
        if replaced is None:
            return
        what, swapped = replaced
        if swapped:
            error = UnsupportedModelError(
                f"clock {self.clock}: {what} of the wrapped model was swapped for another tensor for the call "
                "(torch.func.functional_call with tensors of its own, or another reparametrization of the module), "
                "which the adapter cannot follow: the servers hold the parameters wrap() found and every clock reads "
                "their values into those, so the forward must use them. Pass the wrapped module's own parameters "
                "(functional_call(model, dict(model.named_parameters()), ...)) and compute other weights inside the "
                "model's forward; this model cannot go on: unwrap() and wrap the module on a new job's worker"
            )
        else:
            error = UnsupportedModelError(
                f"clock {self.clock}: {what} of the wrapped model was replaced or removed after wrap() (a new head "
                "assigned to model.module, say; or swapped for the call by torch.func.functional_call, which must "
                "get the wrapped module's own parameters), which is not supported: the servers hold the parameters "
                "wrap() found and every clock must run the layers its recording pass saw, so a new module's "
                "parameters would never train. Make such changes before wrap(), or unwrap() and wrap the module on a "
                "new job's worker"
            )
        self._fail(error)
        raise error

    def _earlier_graph(self) -> OutOfOrderError:
        """The error for a backward pass that reached an earlier forward's graph."""
        return OutOfOrderError(
            f"clock {self.clock}'s backward pass reached the graph of an earlier forward pass: a tensor an earlier "
            "forward made (an RNN's hidden state carried into the next step, say) is part of this clock's loss; "
            "detach it between steps (h = h.detach()), as truncated backpropagation through time does (each "
            "clock's updates leave at its own step())"
        )

    def _refuse_create_graph(self) -> None:
        """In a backward pass through the model: one with create_graph=True
        (a gradient penalty, double backward; grad mode is on in it) is
        refused before it adds anything to the gradients."""
        if torch.is_grad_enabled():
            raise UnsupportedModelError(
                f"clock {self.clock}: a backward pass with create_graph=True through the wrapped model (a gradient "
                "penalty such as WGAN-GP's or R1, a penalty on the gradients' norm, MAML's inner step: "
                "torch.autograd.grad(..., create_graph=True)) is not supported: each clock's update leaves from one "
                "first-order backward pass, which cannot be differentiated again. Train without the term, or "
                "compute it on a model outside the wrapped one"
            )

    def _refuse_swapped_for_the_call(self) -> None:
        """Before a clock starts: a parameter swapped for another tensor for
        the length of the call (``torch.func.functional_call`` with tensors of
        its own) is refused before anything reaches the engine, so the model
        goes on once the call restored it (a check of each parameter's place
        in its module, about as costly as a dict lookup each)."""
        if self._param_places is None:
            places = []
            for layer in self.layers:
                for slot in layer.params:
                    owner_name, _, leaf = slot.name.rpartition(".")
                    owner = _module_at(self.model, owner_name)
                    if owner is not None:
                        places.append((owner._parameters, leaf, slot.param, slot.name))
            self._param_places = places
        for parameters, leaf, param, name in self._param_places:
            now = parameters.get(leaf)
            if now is not param and isinstance(now, torch.Tensor):
                raise UnsupportedModelError(
                    f"clock {self.clock}: parameter {name!r} of the wrapped model is not the one wrap() took: swapped "
                    "for another tensor for this call (torch.func.functional_call with tensors or parameters of its "
                    "own, or another reparametrization of the module) or replaced by a new nn.Parameter, which the "
                    "adapter cannot follow: the servers hold the parameters wrap() found and every clock reads their "
                    "values into those, so the forward must use them (tensors computed from them before the forward "
                    "hold NaN placeholders). Pass the wrapped module's own parameters (functional_call(model, "
                    "dict(model.named_parameters()), ...)) and compute other weights inside the model's forward; "
                    "refused before the clock started, so the model goes on with its own parameters in place"
                )

    def _replaced(self) -> tuple[str, bool] | None:
        """The first module or parameter of the layers that is no longer
        where wrap() found it in the model, in words, and whether it is a
        parameter swapped for a plain tensor (what torch.func.functional_call
        does for the length of the call: ``nn.Module.__setattr__`` refuses to
        put one there for good); None if every one is where it was. A walk
        over the layers, made only once a clock has failed."""
        for layer in self.layers:
            for name, module in (*layer.members, *layer.callers):
                if _module_at(self.model, name) is not module:
                    return f"module {name!r}", False
            for slot in layer.params:
                if _parameter_at(self.model, slot.name) is not slot.param:
                    owner_name, _, leaf = slot.name.rpartition(".")
                    owner = _module_at(self.model, owner_name)
                    now = None if owner is None else owner._parameters.get(leaf)
                    swapped = isinstance(now, torch.Tensor) and not isinstance(now, nn.Parameter)
                    return f"parameter {slot.name!r}", swapped
        return None

    def _mismatch_cause(self, expected: Event | None) -> str:
        """The likely cause of a clock that left the recorded order, where
        it is one a loop can fix (for :meth:`_next`'s error)."""
        frozen = [slot.name for layer in self.layers for slot in layer.params if not slot.param.requires_grad]
        if frozen:
            return (f"; parameter(s) {', '.join(repr(n) for n in frozen[:4])} were frozen after wrap() "
                    "(requires_grad_(False)), which changes what autograd saves: the servers train every "
                    "parameter wrap() took, so freeze before wrapping (or unwrap() and wrap again)")
        if expected is not None and expected.kind == "update" and self._phase is Phase.BACKWARD:
            return (f"; the gradients of layer {self.layers[expected.layer].name!r} never reached .grad, from "
                    "which its update leaves: a parameter this forward did not use where the recording's did (a "
                    "branch that depends on the data), or gradients computed by torch.autograd.grad or "
                    "backward(inputs=...), which do not accumulate them there; every clock must give every "
                    "parameter wrap() took a gradient, through loss.backward()")
        return ""

    # -- the forward pass ---------------------------------------------------------------
    def _check_inputs(self, inputs: Any) -> None:
        """With stored activations, refuses inputs (``(args, kwargs)``) of shapes the slots cannot
        take (larger than example_input's; any other while recomputing,
        whose programs replay the recorded shapes) before the clock starts,
        so that it can go on with other inputs: found at a saved tensor, the
        clock's accesses would be half done."""
        if not self._store_activations or self.input_shapes is None or inputs is None:
            return
        shapes = input_shapes(*inputs)
        recorded = self.input_shapes
        number = -1 if self.input_layouts is None else same_layouts(input_layouts(*inputs), self.input_layouts)
        if number >= 0 and len(shapes) == len(recorded):
            tensor = list(tensors_in(inputs))[number]
            raise IterationMismatchError(
                f"clock {self.clock}: input tensor #{number} {tuple(tensor.shape)} has strides "
                f"{tuple(tensor.stride())}, another memory layout than example_input's; with store_activations the "
                "activations are stored with the recorded layouts, so every clock's inputs must have example_input's "
                "(a slice such as x[:, :n] is a view with gaps: pass x[:, :n].contiguous()); nothing of this clock was "
                "done, so it can go on with other inputs"
            )
        if shapes == recorded:
            return
        if len(shapes) != len(recorded):
            raise IterationMismatchError(
                f"clock {self.clock}: the forward got {len(shapes)} tensors, example_input and example_kwargs "
                f"{len(recorded)}; with store_activations the recording pass must see the tensors every clock "
                "passes: give wrap() a call like the training batches' (example_kwargs= for keyword tensors); "
                "nothing of this clock was done, so it can go on with other inputs"
            )
        recomputing = self._acts.recomputing
        larger = any(len(now) != len(then) or any(a > b for a, b in zip(now, then))
                     for now, then in zip(shapes, recorded))
        if recomputing or larger:
            raise IterationMismatchError(
                f"clock {self.clock}: the inputs are {shapes}, example_input's {recorded}; with store_activations "
                "the recording pass sizes the stored activations, so "
                + ("with recomputed activations every clock must have the recorded shapes (the backward pass "
                   "replays the recorded ops): keep the batch size (DataLoader(..., drop_last=True)) or use "
                   "wrap(..., recompute='none'), with which smaller inputs work" if recomputing else
                   "no input may be larger than example_input: give wrap() the largest (an evaluation forward, "
                   "which may take any batch, runs under torch.no_grad())")
                + "; nothing of this clock was done, so it can go on with other inputs"
            )

    def _check_parameter_writes(self, *, between_passes: bool = False) -> None:
        """Refuses a forward pass that wrote a parameter in place: the write
        lands in the engine's read buffer and would be lost at the next read,
        where torch would keep it (nn.Embedding(max_norm=...) renormalises
        the rows it looks up so); ``between_passes``: before a clock's next
        forward pass, a write since its last backward pass (SAM's
        perturbation of the weights)."""
        for number, versions in self._bound_versions.items():
            layer = self.layers[number]
            name = layer.changed_since(versions)
            if name is None:
                continue
            when = ("between the backward pass and the next forward pass of the clock (SAM's perturbation "
                    "p.add_(e), say)" if between_passes else
                    "during the forward pass (nn.Embedding with max_norm renormalises its rows so, as would a weight "
                    "clamp in a forward pre-hook)")
            with self._mutating():
                raise UnsupportedModelError(
                    f"parameter {name!r} was written in place {when}; the servers hold the parameters and apply only "
                    "the update of each clock, so the write would be lost at the next read: remove the in-place "
                    "write" + ("" if between_passes else " (for an Embedding, drop max_norm)")
                )
