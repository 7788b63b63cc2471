"""The plan made from the recording: the access pattern (held reads, or the
GeePS pattern of reading again) chosen by the engine's dry runs under the
device budget and replayed as the worker's virtual iteration; then
committed (the initial values written, the engine's iterations started) or
given up; and what the plan chose and found, in words and bytes, for
``PSModule.plan`` and ``wrap()``'s later choices."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mltuner.client._worker import Table
from mltuner.exceptions import ResourceExhaustedError
from mltuner.torch._errors import UnsupportedModelError
from mltuner.torch._layer_hooks import LayerHooks
from mltuner.torch._pattern import reason, refusal
from mltuner.torch._recording import Event, Tables, create_tables, for_holding, replay, reuse_tables, store_groups

__all__ = ["Planning"]


# An initial value worker 0 wrote to the servers and freed (commit_plan).
_WRITTEN = torch.empty(0)


class Planning(LayerHooks):
    """Prepares, commits or gives up a clock driver's plan (module
    docstring)."""

    # -- what the plan chose -----------------------------------------------------------------
    @property
    def hold_reads(self) -> bool:
        """Whether the plan holds forward reads through the backward pass."""
        return self._hold

    @property
    def overlap_updates(self) -> bool:
        """Whether updates ship from the backward pass (as given to the driver)."""
        return self._overlap

    @property
    def ships_at_step(self) -> bool:
        """Whether the gradients stay in ``.grad`` until step(), which ships
        them all (the light clock without overlap_updates)."""
        return self._at_step

    @property
    def accesses(self) -> list[str]:
        """The recorded clock's accesses, in order, described in words."""
        return [self._describe(event) for event in self._events]

    @property
    def saved_activations(self) -> list[str]:
        """Each saved activation of the recorded clock (with
        ``store_activations``) in words: stored, or how it is recomputed."""
        return self._acts.describe()

    @property
    def recompute_summary(self) -> str:
        """How many saved activations are stored and how many recomputed, in
        words (``PSModule.plan``); empty without stored activations."""
        if not self._store_activations:
            return self.keep_choice  # why wrap() stopped storing them, if it did
        # recompute="auto" that chose to store everything says so in place of the
        # summary's own reason for recomputing nothing.
        chose_none = self.auto_choice if not self._acts.recompute and not self._acts.fell_back else ""
        summary = self._acts.summary(why_none=chose_none)
        choices = "; ".join(why for why in (self.auto_choice, self.keep_choice) if why and why != chose_none)
        return f"{summary} ({choices})" if choices else summary

    @property
    def unreproducible(self) -> dict[int, str]:
        """Recording: the saved activations that could not be recomputed bit
        for bit, and why (``wrap()`` records again with them stored)."""
        return self._acts.unreproducible

    # -- preparing it -----------------------------------------------------------------------
    def prepare_plan(self, hold_reads: bool | None, tables: Tables | None = None, reserved: int = 0) -> None:
        """Creates the tables (or takes ``tables``, those of an earlier
        recording of the same model: :meth:`release_tables`) and replays the
        recording as the worker's virtual iteration, in the access pattern
        chosen; the engine's dry run keeps the plan that fits, for
        :meth:`commit_plan` or :meth:`release_tables` next. ``reserved``:
        the device memory saved activations autograd keeps take beside the
        engine (left out of its budget).

        ``hold_reads``: hold each layer's forward read until its update, or
        (False) post it after the layer's forward and read the rows again
        for the backward pass (GeePS). None chooses: held reads unless
        ``store_activations`` or the device-memory budget cannot hold the
        access-buffer pool they need, which the engine's plan says
        (:meth:`Worker.preview_plan`, a dry run) before anything is
        committed; where held reads fit but their plan swaps parameters over
        the host link, reading again is planned too and taken if it moves
        fewer bytes. The budget is ``Config.device_memory_budget`` or, with
        none set and a device too small for the plan, the engine's automatic
        one (the device's free memory less ``Config.device_memory_reserve``).

        Raises:
            mltuner.ResourceExhaustedError: the budget cannot hold the pool of
                the pattern given (or, choosing, of either); the message
                gives the bytes each needs.
        """
        worker = self.worker
        worker.reserve_device_memory(reserved)
        budget = worker.config.device_memory_budget  # until a preview says what the plan is made under
        if self.device.type == "cuda":
            # Memory torch cached and no longer uses (the model's parameters
            # before the recording moved them) back to the device, so that
            # the engine's automatic budget and the shard's placement see it.
            torch.cuda.empty_cache()
        tables = (create_tables(worker, self.layers, self._acts.slots, row_width=self._row_width) if tables is None
                  else reuse_tables(worker, tables, self.layers, self._acts.slots, row_width=self._row_width))
        self._all_tables = tables
        self._tables = tables.layers
        recorded = list(self._events)
        preferred = not self._store_activations if hold_reads is None else hold_reads
        candidates = [preferred, False] if hold_reads is None and preferred else [preferred]
        if self._reruns:  # activation checkpointing: the re-run layers need their reads held
            if not preferred:
                names = ", ".join(repr(self.layers[n].name) for n in sorted(self._reruns))
                raise UnsupportedModelError(
                    f"layer(s) {names} run again in the backward pass (activation checkpointing, "
                    "torch.utils.checkpoint), which needs each layer's forward read held until its update: not "
                    "with hold_reads=False or store_activations=True; drop the checkpointing to use those "
                    "(store_activations with recompute= frees activations under a device budget instead)"
                )
            candidates = [True]
        least: dict[bool, int] = {}  # the least pool (= budget) of each pattern tried
        chosen: bool | None = None
        for hold in candidates:
            self._replay(tables, recorded, hold)
            preview = worker.preview_plan()  # the engine keeps a plan that fits: finish uses it
            self._preview = preview
            if budget == 0 and not preview.automatic_budget:  # none set, and the device holds the plan
                chosen = hold
                break
            budget = preview.budget_bytes  # Config's, or the engine's automatic one
            least[hold] = preview.pool_min_bytes
            if preview.fits:
                chosen = hold
                break
            worker.reset_virtual_iteration()
            if self._acts.recomputing and self._recompute_fallback:
                # Recomputing reads some layers' parameters early in the
                # backward pass; storing everything may need a smaller pool.
                recorded, self._recorded_forward_events = self._acts.store_everything(
                    f"recompute='auto' stores them all: recomputing needs a device_memory_budget of at least "
                    f"{preview.pool_min_bytes} bytes, above the {budget} bytes given")
                tables = reuse_tables(worker, tables, self.layers, self._acts.slots, row_width=self._row_width)
                self._all_tables = tables
                self._replay(tables, recorded, hold)
                preview = worker.preview_plan()
                self._preview = preview
                # The least the refusal names: the smaller of the two plans, either of which "auto" takes.
                least[hold] = min(least[hold], preview.pool_min_bytes)
                if preview.fits:
                    chosen = hold
                    break
                worker.reset_virtual_iteration()
        swaps: tuple[int, int] | None = None  # held reads' and reading again's bytes over the link, when compared
        if chosen is True and hold_reads is None and budget > 0 and self.link_bytes > 0 and not self._reruns:
            # Held reads fit, but their pool takes budget the stores then
            # lack: parameters swap over the host link each clock. Reading
            # again needs a pool of about two layers, so the stores keep
            # more; it wins where it moves fewer bytes.
            held = self.link_bytes
            worker.reset_virtual_iteration()
            self._replay(tables, recorded, False)
            self._preview = worker.preview_plan()
            least[False] = self._preview.pool_min_bytes
            if self._preview.fits and self.link_bytes < held:
                chosen, swaps = False, (held, self.link_bytes)
            else:
                worker.reset_virtual_iteration()
                self._replay(tables, recorded, True)
                self._preview = worker.preview_plan()  # the engine keeps this plan for finish
        if chosen is None:
            if False not in least:  # for the message: what reading again would need
                self._replay(tables, recorded, False)
                least[False] = worker.preview_plan().pool_min_bytes
            note = ("; recomputing saved activations (recompute='cheap' or 'compute') reads some layers' "
                    "parameters earlier in the backward pass, which can raise the least budget: recompute='none' "
                    "may need less (and recompute='auto' falls back to it)" if self._acts.recomputing else "")
            if self._reruns:  # held reads were the only pattern tried
                names = ", ".join(repr(self.layers[n].name) for n in sorted(self._reruns))
                raise ResourceExhaustedError(
                    f"layer(s) {names} run again in the backward pass (activation checkpointing, "
                    "torch.utils.checkpoint), which needs each layer's forward read held until its update: a "
                    f"Config.device_memory_budget of at least {least[True]} bytes, above the {budget} bytes given; "
                    "drop the checkpointing to read each layer again for its backward pass, which needs "
                    f"{least[False]} bytes (store_activations with recompute= frees activations under a budget "
                    "instead)" + note)
            raise ResourceExhaustedError(refusal(hold_reads, least, budget, worker.config.prefetch_clocks) + note)
        self.hold_choice = reason(hold_reads, self._store_activations, chosen, least, budget, swaps)

    def _replay(self, tables: Tables, recorded: list[Event], hold: bool) -> None:
        """Takes the recorded clock with held reads or without, and records
        it as the worker's virtual iteration."""
        self._hold = hold
        self._events = for_holding(recorded) if hold else list(recorded)
        forward = recorded[: self._recorded_forward_events]
        self._forward_events = len(for_holding(forward) if hold else forward)
        # The light clock needs every saved parameter view in a held read:
        # one read per layer, held until its update (_clock.py's docstring).
        reads = [0] * len(self.layers)
        for event in self._events:
            if event.kind == "read":
                reads[event.layer] += 1
        self._light = hold and not self._store_activations and all(count == 1 for count in reads)
        self._at_step = self._light and not self._overlap
        if self._at_step:
            # Forward order: the next clock's first read waits for the first
            # layer's update, which the engine then handles first.
            first_read = {e.layer: i for i, e in enumerate(self._events[: self._forward_events]) if e.kind == "read"}
            self._events[self._forward_events:] = sorted(self._events[self._forward_events:],
                                                         key=lambda e: first_read[e.layer])
        self._groups = store_groups(self._events, self._acts.slots, tables,
                                    max(4 * layer.num_values for layer in self.layers))
        self._spans = {}
        for members in set(self._groups.values()):
            offset = 0
            for slot in members:
                self._spans[slot] = (offset, self._acts.slots[slot].nbytes // 4)
                offset += len(tables.slot_rows(slot)[1]) * self._row_width
        self._handles = replay(self.worker, tables, self._events, slack=self._slack, hold_reads=hold,
                               batched=self._light, groups=self._groups)

    @property
    def link_bytes(self) -> int:
        """The bytes the prepared plan moves per clock over the busier
        direction of the host link (its swaps)."""
        assert self._preview is not None
        return max(self._preview.host_to_device_bytes, self._preview.device_to_host_bytes)

    @property
    def budget_bytes(self) -> int:
        """The device budget the prepared plan is made under (0: none)."""
        assert self._preview is not None
        return self._preview.budget_bytes

    @property
    def slot_bytes(self) -> list[int]:
        """The bytes of each saved activation the recording found."""
        return [slot.nbytes for slot in self._acts.slots]

    @property
    def recomputed_bytes(self) -> int:
        """The bytes of the saved activations the recording chose to
        recompute (stored instead, they would cross the host link at most
        once each way a clock)."""
        return sum(slot.nbytes for slot in self._acts.slots if slot.recomputed)

    def device_slots(self) -> tuple[frozenset[int], bool]:
        """The stored activations the prepared plan keeps on the device
        (never swapped), and whether that is all of them."""
        assert self._preview is not None
        on_device = self._preview.device_local_accesses
        slots: set[int] = set()
        stored: set[int] = set()
        for event, handle in zip(self._events, self._handles):
            if event.kind == "store":
                stored.add(event.slot)
                if handle >= 0 and handle in on_device:
                    slots.update(self._groups.get(event.slot, (event.slot,)))
        return frozenset(slots), slots == stored

    @property
    def forward_work(self) -> tuple[int, int]:
        """The recorded forward's flops (convolutions and matrix products)
        and aten ops; (0, 0) unless the recording traced it to recompute."""
        return self._acts.forward_work

    # -- committing it, or giving it up -------------------------------------------------------
    def release_tables(self) -> Tables:
        """Gives up the prepared plan (or a failed one) and the recording:
        the worker's virtual iteration is dropped and the model gets its
        initial values back. Returns the tables, for the next recording."""
        assert self._all_tables is not None
        self.worker.reset_virtual_iteration()
        self.abandon()
        return self._all_tables

    def abandon(self) -> None:
        """After a failed wrap(): gives the model its initial values back and
        removes the hooks, so the plain module is usable again."""
        self.remove_hooks()
        for layer, flat in zip(self.layers, self._init):
            if flat is not _WRITTEN:  # written to the servers and freed (commit_plan): its placeholder stays
                layer.bind_flat(flat.to(self.device))  # kept in host memory for the plan on CUDA (record)
        self._closed = True

    def commit_plan(self, restore: Callable[[], None] | None = None) -> None:
        """Commits the prepared plan, writes the initial values (worker 0),
        or calls ``restore`` on every worker instead (a checkpoint's values
        loaded into the shards), and starts the engine's iterations. A
        barrier over all workers."""
        worker = self.worker
        self._acts.end_planning()
        # The initial values in host memory are freed as they are written (a
        # shard whose state lives in host memory allocates each table's then):
        # the plan may count them as room for that state.
        worker.release_host_memory_during_init(
            sum(flat.numel() * flat.element_size() for flat in self._init if flat.device.type == "cpu"))
        worker.finish_virtual_iteration()
        if restore is not None:
            restore()
        elif worker.rank == 0:  # the initial values: worker 0's model, added to the servers' zeros
            # Each layer's copy freed once written, where it makes room for the
            # shard's state; else all at the end, so that a failed write can
            # still give the module its initial values back (abandon).
            free_as_written = bool(worker.stats["shard_in_host_memory"])
            updates = {e.layer: self._handles[i] for i, e in enumerate(self._events) if e.kind == "update"}
            for layer in self.layers:
                handle = updates[layer.index]
                # From host memory straight to the servers (record() keeps the
                # initial values there), with no device buffer in between.
                worker.write_initial(handle, self._init[layer.index].cpu().numpy())
                if free_as_written:
                    self._init[layer.index] = _WRITTEN
        self._init.clear()
        worker.start_iterations()
        self.note_idle_versions()
        self._shipped_why = self._why_shipped()
        if self._light:
            self._plan_batches()
        else:
            self._start_loss_guard(between_clocks=True)
        if self._at_step:  # gradients are picked up at step(): no Python call per parameter in backward
            for handle in self._grad_hooks:
                handle.remove()
            self._grad_hooks.clear()
            # The forward binds every layer up front: the layer hooks stay only
            # to refuse a layer called outside the wrapped model's forward.
            self._layer_hooks = [(hooks, handle.id, hooks[handle.id]) for handle in self._hooks
                                 if (hooks := handle.hooks_dict_ref()) is not None]

    def rule_has_state(self) -> bool:
        """Whether the servers keep optimizer state (momentum, Adam's
        moments) for some layer's table."""
        return any((rule := self.worker.update_rule_of(table)) is not None and rule.state_arrays
                   for table in self._tables)

    @property
    def tables(self) -> list[Table]:
        """The layers' tables, in layer order (empty before :meth:`prepare_plan`)."""
        return list(self._tables)
