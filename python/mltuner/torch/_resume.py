"""A wrapped model's checkpoints: what the job's checkpoint lacks for
resuming a PyTorch training run.

The job's checkpoint (``Job.save_checkpoint``) holds every table's values
and the servers' optimizer state (momentum buffers, Adam's moments and step
count), sharded as the servers hold them. A model also has state outside the
tables: its buffers (batch-norm running statistics), frozen parameters and
``get_extra_state()``, the optimizer's param groups (a scheduler's current
``lr``, ``initial_lr``), and whatever the loop keeps (its epoch, a
scheduler's ``state_dict()``). Rank 0 attaches these to the checkpoint as two
files, read back without pickle:

- ``torch-adapter.json``: the optimizer's class and param groups' settings,
  the trainable parameters' shapes (checked on resume: another model's
  may fill the same table rows), where each lies in the tables (a resume
  whose budget or batch groups the layers otherwise assembles its tables
  from them), the strides of those kept in a memory format of their own
  (their rows hold them in that order: checked on resume), the index of the local tensors (name, dtype, shape, byte
  offset) and the loop's ``user_state``;
- ``torch-local.bin``: those tensors' bytes, one after another.

Every rank takes rank 0's local tensors on resume, as DDP broadcasts rank
0's buffers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mltuner._validate import is_real
from mltuner.exceptions import InvalidArgumentError, NotFoundError
from mltuner.launch import _checkpoint
from mltuner.torch._layers import Layer, contiguous_strides, memory_order, memory_strides
from mltuner.torch._optim import plain_setting
from mltuner.torch._recording import table_name

__all__ = ["Resumed", "SavedModelState", "attachments", "read_saved", "set_group_settings"]

FORMAT = "mltuner-torch-adapter"
VERSION = 1
INDEX = "torch-adapter.json"
TENSORS = "torch-local.bin"


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a model wrapped with ``resume_from`` started from."""

    path: Path  # the checkpoint directory
    clock: int  # the clocks trained before it was saved (the job's clock count)
    user_state: Any  # what save_checkpoint(user_state=...) was given (JSON values), or None
    # The optimizer's param groups as saved, in torch's state-dict format (no
    # per-parameter state: the servers' came back with the tables). wrap()
    # loads them; a scheduler made after wrap() may write its own lr when
    # made, so load them again after it: model.optimizer.load_state_dict().
    optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SavedModelState:
    """A checkpoint's model state outside the tables, checked against the
    module it will be loaded into."""

    path: Path
    groups: list[dict[str, Any]]
    local: dict[str, torch.Tensor | Any]  # state_dict entries: tensors, or extra state (JSON values)
    user_state: Any
    # Each table's name -> its parameters' names -> their offsets in its flat
    # values, as saved, and the tables' row width (None: a checkpoint of
    # before they were saved).
    tables: dict[str, dict[str, int]] | None = None
    row_width: int | None = None

    def sources(self, module: nn.Module, layers: list[Layer]) -> _checkpoint.Sources | None:
        """Where the tables of ``layers`` come from in the saved ones, when
        they group the parameters otherwise (None: the same tables)."""
        mine = {table_name(layer): {slot.name: slot.offset for slot in layer.params} for layer in layers}
        same_width = all(layer.layout.row_width == self.row_width for layer in layers)
        if self.tables is None or (self.tables == mine and same_width):
            return None
        saved_at = {name: (table, offset) for table, params in self.tables.items() for name, offset in params.items()}
        names: dict[int, list[str]] = {}  # a tied parameter's names: the saved table may have it under another
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        sources = {}
        for layer in layers:
            pieces = []
            for slot in layer.params:
                where = next((saved_at[n] for n in names.get(id(slot.param), [slot.name]) if n in saved_at), None)
                if where is None:
                    raise InvalidArgumentError(f"checkpoint {self.path} holds no table rows of parameter {slot.name!r}")
                pieces.append((slot.offset, where[0], where[1], slot.numel))
            sources[table_name(layer)] = pieces
        return sources

    def load_local(self, module: nn.Module) -> None:
        """Copies the saved buffers, frozen parameters and extra state into
        ``module`` (whose entries read_saved checked)."""
        targets = _local_entries(module)
        with torch.no_grad():
            for name, value in self.local.items():
                if name == _EXTRA or name.endswith("." + _EXTRA):
                    module.get_submodule(name[: -len(_EXTRA)].rstrip(".")).set_extra_state(value)
                else:
                    targets[name].copy_(value)


def set_group_settings(groups: list[dict[str, Any]], saved: list[dict[str, Any]],
                       keys: tuple[str, ...] | None = None) -> None:
    """Sets each param group's settings from ``saved``, as torch's
    ``Optimizer.load_state_dict`` does (``lr``, ``initial_lr``, momentum,
    betas, ...; only ``keys`` where given; never ``params``)."""
    for group, settings in zip(groups, saved):
        for key, value in settings.items():
            if key != "params" and (key in group or key == "initial_lr") and (keys is None or key in keys):
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


_EXTRA = "_extra_state"


def _local_entries(module: nn.Module) -> dict[str, Any]:
    """``module``'s state_dict entries that are not trainable parameters
    (buffers, frozen parameters, extra state), by name; tensors are the
    module's own (keep_vars)."""
    return {name: value for name, value in module.state_dict(keep_vars=True).items()
            if not (isinstance(value, nn.Parameter) and value.requires_grad)}


def _trainable_shapes(module: nn.Module) -> dict[str, list[int]]:
    """The shapes of the trainable parameters, by name: the tables hold them
    in rows, where another model's may fit as well."""
    return {name: list(param.shape) for name, param in module.named_parameters() if param.requires_grad}


def _memory_formats(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The strides of the trainable parameters kept in a memory order of
    their own (:func:`~mltuner.torch._layers.memory_strides`), by name."""
    return {name: strides for name, param in module.named_parameters() if param.requires_grad
            and (strides := memory_strides(param)) is not None}


def _format_hint(shape: Sequence[int], saved: Sequence[int], recorded: bool) -> str:
    """What to give the module to resume a parameter saved with strides
    ``saved`` (``recorded``: the checkpoint records memory formats)."""
    order = memory_order(shape, saved)
    if order == memory_order(shape, None):
        hint = "give the module that memory format, module.to(memory_format=torch.contiguous_format), before wrap()"
    elif len(shape) in (4, 5) and order == tuple(d for d in (0, *range(2, len(shape)), 1) if shape[d] != 1):
        # channels_last (3d): N outermost, then the spatial dimensions, C innermost
        name = "torch.channels_last" if len(shape) == 4 else "torch.channels_last_3d"
        hint = f"give the module that memory format, module.to(memory_format={name}), before wrap()"
    else:
        hint = "give the parameter those strides (a tensor laid out so, e.g. a transposed one) before wrap()"
    if not recorded:  # saved before checkpoints recorded formats: every parameter's rows were contiguous
        hint += " (this checkpoint is from before mltuner kept memory formats: its parameters are all contiguous)"
    return hint


def _json_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups as torch's ``Optimizer.state_dict`` gives them: their
    settings, and ``params`` numbered across the groups."""
    saved = []
    numbered = 0
    for group in groups:
        settings: dict[str, Any] = {"params": list(range(numbered, numbered + len(group["params"])))}
        numbered += len(group["params"])
        for key, value in group.items():
            if key == "params":
                continue
            try:
                value = plain_setting(value)  # a tensor lr or betas (torch allows them) as numbers
                json.dumps(value)
            except (TypeError, ValueError, RuntimeError):
                continue  # not a setting torch's schedulers write (a callable, a tensor of many values)
            settings[key] = value
        saved.append(settings)
    return saved


def attachments(module: nn.Module, layers: list[Layer], groups: list[dict[str, Any]], optimizer: str | None,
                user_state: Any) -> dict[str, bytes]:
    """The files rank 0 attaches to the job's checkpoint (module docstring)."""
    try:
        user_json = json.loads(json.dumps(user_state))
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"save_checkpoint: user_state must be JSON values (dicts, lists, numbers, "
                                   f"strings): {error}") from None
    index: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    offset = 0
    for name, value in _local_entries(module).items():
        if not isinstance(value, torch.Tensor):
            try:
                index.append({"name": name, "json": json.loads(json.dumps(value))})
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"save_checkpoint: {name!r} (a module's get_extra_state()) is not JSON "
                                           "values; the checkpoint stores no pickles") from None
            continue
        data = value.detach().to("cpu", copy=True).contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        index.append({"name": name, "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                      "offset": offset, "bytes": len(raw)})
        blobs.append(raw)
        offset += len(raw)
    content = {"format": FORMAT, "version": VERSION, "optimizer": optimizer, "groups": _json_groups(groups),
               "local": index, "parameters": _trainable_shapes(module),
               "tables": {table_name(layer): {slot.name: slot.offset for slot in layer.params} for layer in layers},
               "strides": {slot.name: list(slot.stride) for layer in layers for slot in layer.params
                           if slot.stride is not None},
               "row_width": layers[0].layout.row_width if layers else None,
               "user_state": user_json}
    return {INDEX: json.dumps(content).encode(), TENSORS: b"".join(blobs)}


def read_saved(path: str | os.PathLike[str], module: nn.Module, optimizer: str | None,
               num_groups: int, *, rank: int = 0,
               agree: Callable[[str, Any], list[Any]] | None = None) -> SavedModelState:
    """The model state a checkpoint holds outside the tables, checked
    against ``module`` (the same trainable parameters, buffers, frozen
    parameters and extra state, with the same shapes and dtypes), the
    optimizer's class name (None: the Config's rule) and the number of
    param groups. A root names its newest checkpoint as rank 0 finds it
    (``agree``: the job's allgather, every rank calling this).

    Raises:
        mltuner.NotFoundError: no complete checkpoint at ``path``.
        mltuner.InvalidArgumentError: it was not saved by a wrapped model's
            ``save_checkpoint``, or saved from another model or optimizer.
    """
    directory = _checkpoint.resolve_together(Path(path), rank, agree)
    raw_index = _checkpoint.read_attachment(directory, INDEX)
    if raw_index is None:
        raise NotFoundError(f"{directory} holds no PyTorch model state: it was saved by Job.save_checkpoint, not by "
                            "a wrapped model's save_checkpoint()")
    try:
        index = json.loads(raw_index)
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"not {FORMAT} version {VERSION}")
        tensors = _checkpoint.read_attachment(directory, TENSORS) or b""
        local = dict(_decode(index["local"], tensors))
        groups = _checked_groups(index["groups"])
    except InvalidArgumentError:
        raise  # one that names its file already (a damaged torch-local.bin)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as error:  # RuntimeError: torch's view
        raise InvalidArgumentError(f"{directory / 'attachments' / INDEX} cannot be read: {error}") from None
    problems = []
    if index.get("optimizer") != optimizer:
        problems.append(f"it was trained with {index.get('optimizer') or 'the Config rule'}, this wrap() was given "
                        f"{optimizer or 'no optimizer'}")
    elif len(groups) != num_groups:
        problems.append(f"the optimizer had {len(groups)} param groups there, {num_groups} here")
    trained, here = index.get("parameters", {}), _trainable_shapes(module)
    for name in sorted(set(trained) ^ set(here)):
        where = "the checkpoint" if name in trained else "this module"
        problems.append(f"trainable parameter {name!r} is only in {where}")
    saved_strides, here_strides = index.get("strides", {}), _memory_formats(module)
    if not (isinstance(saved_strides, dict) and all(
            isinstance(strides, list) and len(strides) == len(trained.get(name, ())) and all(
                type(step) is int and step >= 0 for step in strides) for name, strides in saved_strides.items())):
        raise InvalidArgumentError(f"{directory / 'attachments' / INDEX} cannot be read: its 'strides' are not "
                                   "the saved parameters' strides")
    for name in sorted(set(trained) & set(here)):
        if trained[name] != here[name]:
            problems.append(f"{name!r} is {tuple(trained[name])} there, {tuple(here[name])} here")
        elif memory_order(here[name], saved_strides.get(name)) != memory_order(here[name], here_strides.get(name)):
            saved = saved_strides.get(name) or contiguous_strides(here[name])
            problems.append(f"{name!r} has its values in another memory order there (strides {tuple(saved)}, "
                            f"here {here_strides.get(name) or contiguous_strides(here[name])}): "
                            + _format_hint(here[name], saved, "strides" in index))
    mine = _local_entries(module)
    for name in sorted(set(mine) ^ set(local)):
        where = "the checkpoint" if name in local else "this module"
        problems.append(f"{name!r} is only in {where}")
    for name, value in local.items():
        target = mine.get(name)
        if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor) and (
                value.shape != target.shape or value.dtype != target.dtype):
            problems.append(f"{name!r} is {value.dtype} {tuple(value.shape)} there, {target.dtype} "
                            f"{tuple(target.shape)} here")
    if problems:
        raise InvalidArgumentError(f"checkpoint {directory} was saved from another model: " + "; ".join(problems))
    return SavedModelState(directory, groups, local, index.get("user_state"), _saved_tables(directory, index, trained),
                           index.get("row_width"))


def _saved_tables(directory: Path, index: dict[str, Any],
                  shapes: dict[str, list[int]]) -> dict[str, dict[str, int]] | None:
    """The index's "tables", checked to place each trainable parameter (of
    ``shapes``) exactly once, apart from the others of its table."""
    tables = index.get("tables")
    if tables is None:
        return None
    where = f"{directory / 'attachments' / INDEX} cannot be read: its 'tables'"
    if not (isinstance(tables, dict) and all(isinstance(params, dict) for params in tables.values())
            and all(type(offset) is int and offset >= 0 for params in tables.values() for offset in params.values())
            and type(index.get("row_width")) is int and index["row_width"] >= 1):
        raise InvalidArgumentError(f"{where} are not names of tables with their parameters' offsets")
    placed = [name for params in tables.values() for name in params]
    if sorted(placed) != sorted(shapes):
        raise InvalidArgumentError(f"{where} do not place each trainable parameter once")
    for table, params in tables.items():
        end = 0
        for name, offset in sorted(params.items(), key=lambda item: item[1]):
            if offset < end:
                raise InvalidArgumentError(f"{where}: {name!r} overlaps another parameter of {table!r}")
            end = offset + math.prod(shapes[name])
    return tables


def _checked_groups(groups: Any) -> list[dict[str, Any]]:
    """The saved param groups, each a dict whose numeric settings are
    numbers (a hand-edited "lr": "abc" would fail later, naming no file)."""
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise ValueError("'groups' is not a list of param-group dicts")
    for index, group in enumerate(groups):
        for key in ("lr", "initial_lr", "momentum", "dampening", "weight_decay", "eps"):
            value = group.get(key)
            if key in group and not (is_real(value) and math.isfinite(value)):
                raise ValueError(f"param group {index}'s {key!r} is {value!r}, not a finite number")
    return groups


def _decode(entries: list[dict[str, Any]], tensors: bytes) -> Iterator[tuple[str, Any]]:
    for entry in entries:
        name = str(entry["name"])
        if "json" in entry:
            yield name, entry["json"]
            continue
        dtype = getattr(torch, str(entry["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {entry['dtype']!r}")
        start, size = int(entry["offset"]), int(entry["bytes"])
        shape = tuple(int(n) for n in entry["shape"])
        if start < 0 or start + size > len(tensors):
            raise ValueError(f"{name!r} lies outside {TENSORS}")
        raw = torch.frombuffer(bytearray(tensors[start:start + size]), dtype=torch.uint8) if size else \
            torch.empty(0, dtype=torch.uint8)
        yield name, raw.view(dtype).reshape(shape)
