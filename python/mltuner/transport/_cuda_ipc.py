"""Device payloads between the processes of one host: CUDA IPC between GPU
engines, shared memory between CPU engines.

At the rendezvous each process exports a landing region (one slice per
peer; on a GPU, device memory and interprocess events; on a CPU, a memory
file its peers map, ``cpp/src/device/cpu/shared_memory_ipc.h``), and puts
its handle in its card. After the cards are exchanged, each opens the
exports of the peers on its host (same
:func:`~mltuner.transport._address.host_identity`), and the ranks tell each
other which they opened (an allgather on the control channel): a pair moves
payloads directly only when both sides opened the other's, so a notice never
reaches a process that cannot read it. Everything else, and
every payload that finds its slice full, goes through (pinned) host frames
over the socket (``cpp/src/cluster/ipc_links.h`` has the protocol).

Settings: ``Job(cuda_ipc=...)`` or ``MLTUNER_CUDA_IPC`` (``1``/``0``;
default on) and ``Job(cuda_ipc_slice_bytes=...)`` or
``MLTUNER_CUDA_IPC_SLICE_BYTES`` (device memory outside the engine's
budget; by default 2 GiB or a sixteenth of the device's memory, whichever
is less, over the peers, at least 256 MiB each: see
:func:`slice_bytes_for`; on a CPU only what is written takes RAM). The
settings keep their CUDA names for both kinds. The path chosen for each peer
is logged and kept in ``Job.data_paths``: ``"cuda-ipc"``,
``"shared-memory"`` or ``"host-frames (<why>)"``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from mltuner import _core
from mltuner.exceptions import InvalidArgumentError, MltunerError
from mltuner.transport._address import Card

__all__ = ["DEFAULT_REGION_BYTES", "REGION_SHARE_OF_DEVICE", "MIN_SLICE_BYTES", "cuda_ipc_wanted",
           "slice_bytes_setting", "slice_bytes_for", "slice_advice", "export", "connect"]

_log = logging.getLogger("mltuner.transport")
DEFAULT_REGION_BYTES = 2 << 30
REGION_SHARE_OF_DEVICE = 16  # the default region takes at most this fraction (1/16) of the device's memory
MIN_SLICE_BYTES = 256 << 20
_ALIGNMENT = 256  # IpcLinks::kAlignment
_GATHER = "mltuner-cuda-ipc"
CUDA_IPC = "cuda-ipc"
SHARED_MEMORY = "shared-memory"
HOST_FRAMES = "host-frames"
DIRECT_PATHS = {"cuda": CUDA_IPC, "cpu": SHARED_MEMORY}  # by engine device


def cuda_ipc_wanted(setting: bool | None, env: Mapping[str, str] | None = None) -> bool:
    """``setting`` when given, else ``MLTUNER_CUDA_IPC`` (default on)."""
    if setting is not None:
        return setting
    raw = (env if env is not None else os.environ).get("MLTUNER_CUDA_IPC", "").strip().lower()
    if raw in ("", "1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise InvalidArgumentError(f"MLTUNER_CUDA_IPC={raw!r} is not one of 1, 0, on, off, true, false, yes, no")


def slice_bytes_setting(setting: int | None, env: Mapping[str, str] | None = None) -> int | None:
    """The landing slice per peer asked for: ``setting``, else
    ``MLTUNER_CUDA_IPC_SLICE_BYTES``, rounded up to 256 bytes; None when
    neither is set (:func:`slice_bytes_for` chooses)."""
    if setting is None:
        raw = (env if env is not None else os.environ).get("MLTUNER_CUDA_IPC_SLICE_BYTES", "").strip()
        if not raw:
            return None
        try:
            setting = int(raw)
        except ValueError:
            raise InvalidArgumentError(f"MLTUNER_CUDA_IPC_SLICE_BYTES={raw!r} is not an integer") from None
    if isinstance(setting, bool) or not isinstance(setting, int) or not 1 <= setting <= 1 << 40:
        raise InvalidArgumentError(f"the CUDA IPC slice must be an integer in [1, 2**40] bytes, got {setting!r}")
    return _aligned(setting)


def slice_bytes_for(setting: int | None, peers: int, device_bytes: int = -1) -> int:
    """The landing slice per peer: the setting, else
    :data:`DEFAULT_REGION_BYTES` or 1/:data:`REGION_SHARE_OF_DEVICE` of
    ``device_bytes`` (the device's memory; -1: unknown), whichever is less,
    shared by the ``peers``, at least :data:`MIN_SLICE_BYTES`.

    In a clock a peer sends this process about 2 x model bytes / N (its
    update of this shard's rows and the rows of its shard read here), and
    their consumers may hold them for most of the clock. What does not fit
    goes through host frames, tens of milliseconds a payload: a
    108-M-parameter transformer on two H200s ran at 0.70 of DDP's speed with
    256-MiB slices and 0.97 with 1 GiB. A region of 2 GiB holds a clock of
    a model up to 1-2 GiB, whatever N; on a small GPU the share bounds what
    the region takes from the model."""
    if setting is not None:
        return setting
    region = DEFAULT_REGION_BYTES if device_bytes < 0 else min(DEFAULT_REGION_BYTES,
                                                               device_bytes // REGION_SHARE_OF_DEVICE)
    return _aligned(max(MIN_SLICE_BYTES, region // max(peers, 1)))


def slice_advice(per_clock_bytes: int, slice_bytes: int) -> str | None:
    """A warning, in words, when a clock's payloads from one peer
    (``per_clock_bytes``, from the tables) exceed the landing slice; None
    when they fit."""
    if per_clock_bytes <= slice_bytes:
        return None
    mib = 1 << 20
    wanted = -(-per_clock_bytes // mib)
    return (f"mltuner: a clock moves about {per_clock_bytes / mib:.0f} MiB from each peer to this process, more than "
            f"its {slice_bytes / mib:.0f}-MiB landing slice per peer (CUDA IPC or shared memory): payloads that "
            f"find the slice full wait, then go through host frames, tens of milliseconds each. "
            f"Job(cuda_ipc_slice_bytes=) or MLTUNER_CUDA_IPC_SLICE_BYTES={wanted * mib} (memory per peer) sets a "
            f"slice that holds a clock.")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def export(node: _core.ProcessNode, device: str, wanted: bool, slice_bytes: int) -> tuple[dict[str, Any] | None, str]:
    """This process's card entry (None when it offers no CUDA IPC) and why
    not, in words."""
    if not wanted:
        return None, "turned off (Job(cuda_ipc=False) or MLTUNER_CUDA_IPC=0)"
    if device not in DIRECT_PATHS:
        return None, f"a {device} engine"
    if int(node.num_workers) < 2:
        return None, "a job of one process"
    try:
        handle = node.export_cuda_ipc(slice_bytes)
    except MltunerError as error:
        _log.warning("mltuner: rank %d cannot export its %s region, so its peers on this host get host frames: %s",
                     node.rank, DIRECT_PATHS[device], error)
        return None, f"export failed: {error}"
    return {"handle": handle.hex(), "slice_bytes": slice_bytes}, ""


def connect(node: _core.ProcessNode, device: str, mine: Card, cards: list[Card], why_not: str,
            allgather: Callable[[str, Any], list[Any]]) -> dict[int, str]:
    """Opens the exports of the peers on this host, agrees with them which
    pairs use them, and enables those. Every rank calls it with the same
    cards (it calls ``allgather`` only when some card offers an export).
    Returns each peer's data path in words: ``"cuda-ipc"`` (``device``
    ``"cuda"``), ``"shared-memory"`` (``"cpu"``) or ``"host-frames (<why>)"``."""
    rank = int(node.rank)
    peers = [r for r in range(len(cards)) if r != rank]
    reasons: dict[int, str] = {}
    opened: list[int] = []
    for peer in peers:
        theirs = cards[peer]
        if mine.cuda_ipc is None:
            reasons[peer] = why_not
        elif theirs.host != mine.host:
            reasons[peer] = "another host"
        elif theirs.cuda_ipc is None:
            reasons[peer] = "the peer offers no export"
        else:
            try:
                handle = bytes.fromhex(theirs.cuda_ipc["handle"])
            except ValueError:
                reasons[peer] = "the peer's handle is not hex"
                continue
            try:
                node.open_cuda_ipc_peer(peer, handle, int(theirs.cuda_ipc["slice_bytes"]))
                opened.append(peer)
            except MltunerError as error:
                reasons[peer] = f"opening its export failed: {error}"
    if any(card.cuda_ipc is not None for card in cards):
        everyone = allgather(_GATHER, opened)
        for peer in opened:
            theirs = everyone[peer]
            if isinstance(theirs, list) and rank in theirs:
                node.enable_cuda_ipc_peer(peer)
            else:
                reasons[peer] = "the peer could not open this process's export"
    direct = DIRECT_PATHS.get(device, CUDA_IPC)
    paths = {peer: direct if peer not in reasons else f"{HOST_FRAMES} ({reasons[peer]})" for peer in peers}
    same_gpu = set(node.cuda_ipc_same_device_peers)
    for peer, path in paths.items():
        _log.info("mltuner: rank %d -> rank %d: device payloads by %s%s", rank, peer, path,
                  " (on this process's GPU)" if peer in same_gpu else "")
    return paths
