"""CUDA IPC and shared-memory setup and notice checks that run without a GPU.

The settings (``MLTUNER_CUDA_IPC``, the slice), the card's ``cuda_ipc``
entry (it comes over the network), the pairwise agreement of
:func:`mltuner.transport._cuda_ipc.connect` (a pair uses CUDA IPC only
when both sides opened the other's export), and a node's refusal of
hand-made IPC notices and releases: a node that exported no landing region
finds every one corrupt, counts it, and never reads it. The protocol itself
runs on the CPU in tests/cpp/cluster/ipc_links_test.cc; shared memory
between real processes in tests/python/distributed/test_training.py; the
real CUDA path in tests/python/gpu/test_cuda_ipc.py.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

import mltuner
from mltuner import _core
from mltuner.exceptions import CorruptMessageError, InvalidArgumentError, MltunerError
from mltuner.transport import _cuda_ipc
from mltuner.transport._address import MAX_CUDA_IPC_HANDLE_HEX, Card

_HEADER = "<IHHiiiiqqqIIfI"  # MessageHeader, 64 bytes
_NOTICE, _RELEASE, _ROWS = 14, 15, 3


def _header(kind: int, sender: int, receiver: int, *, row_width: int = 0, spans: int = 0, text: int = 0) -> bytes:
    return struct.pack(_HEADER, 0x4E544C4D, 1, kind, sender, receiver, 0, 0, 0, 0, row_width, spans, text, 0.0, 0)


def _span(offset: int, size: int, event: int = 0) -> bytes:
    return struct.pack("<QQQ", offset, size, event)  # IpcSpan, 24 bytes


def _notice(sender: int, receiver: int, offset: int, size: int, event: int = 0) -> bytes:
    inner = _header(_ROWS, sender, receiver, row_width=2, spans=1) + struct.pack("<qq", 0, 4)  # 4 rows x 2 floats
    span = _span(offset, size, event)
    return _header(_NOTICE, sender, receiver, text=len(span) + len(inner)) + span + inner


def test_settings_come_from_the_argument_then_the_environment() -> None:
    assert _cuda_ipc.cuda_ipc_wanted(None, {}) is True
    assert _cuda_ipc.cuda_ipc_wanted(None, {"MLTUNER_CUDA_IPC": "0"}) is False
    assert _cuda_ipc.cuda_ipc_wanted(None, {"MLTUNER_CUDA_IPC": "on"}) is True
    assert _cuda_ipc.cuda_ipc_wanted(False, {"MLTUNER_CUDA_IPC": "1"}) is False
    with pytest.raises(InvalidArgumentError, match="MLTUNER_CUDA_IPC"):
        _cuda_ipc.cuda_ipc_wanted(None, {"MLTUNER_CUDA_IPC": "maybe"})
    assert _cuda_ipc.slice_bytes_setting(None, {}) is None  # automatic: by the number of peers
    assert _cuda_ipc.slice_bytes_for(None, 1) == 2 << 30
    assert _cuda_ipc.slice_bytes_for(None, 3) == 715_827_968  # 2 GiB / 3, up to 256-byte units
    assert _cuda_ipc.slice_bytes_for(None, 15) == 256 << 20  # never below 256 MiB
    assert _cuda_ipc.slice_bytes_for(4096, 3) == 4096
    # A sixteenth of the device at most: an 8-GiB GPU gives 512 MiB, an 80-GB one the 2 GiB.
    assert _cuda_ipc.slice_bytes_for(None, 1, 8 << 30) == 512 << 20
    assert _cuda_ipc.slice_bytes_for(None, 1, 80 * 10**9) == 2 << 30
    assert _cuda_ipc.slice_bytes_for(None, 7, 8 << 30) == 256 << 20  # the floor: what every peer had before
    assert _cuda_ipc.slice_bytes_for(4096, 1, 8 << 30) == 4096  # a setting is kept
    assert _cuda_ipc.slice_bytes_setting(None, {"MLTUNER_CUDA_IPC_SLICE_BYTES": "1000"}) == 1024  # 256-byte units
    assert _cuda_ipc.slice_bytes_setting(4096, {"MLTUNER_CUDA_IPC_SLICE_BYTES": "1"}) == 4096
    for bad in (0, -1, True, 1 << 41):
        with pytest.raises(InvalidArgumentError):
            _cuda_ipc.slice_bytes_setting(bad, {})
    with pytest.raises(InvalidArgumentError, match="SLICE_BYTES"):
        _cuda_ipc.slice_bytes_setting(None, {"MLTUNER_CUDA_IPC_SLICE_BYTES": "lots"})


def test_a_slice_smaller_than_a_clock_of_traffic_is_named_with_the_setting_that_holds_one() -> None:
    assert _cuda_ipc.slice_advice(256 << 20, 256 << 20) is None
    advice = _cuda_ipc.slice_advice(434_000_000, 256 << 20)
    assert advice is not None
    assert "about 414 MiB" in advice and "256-MiB" in advice
    assert f"MLTUNER_CUDA_IPC_SLICE_BYTES={414 << 20}" in advice  # whole MiB, at least the clock's bytes


def test_cpu_engines_of_one_host_share_memory() -> None:
    nodes = [_core.ProcessNode(mltuner.Config().to_core(), rank, 2) for rank in range(2)]
    entries = [_cuda_ipc.export(node, "cpu", True, 1 << 20) for node in nodes]
    for entry, why in entries:
        assert entry is not None and why == ""
        assert bytes.fromhex(entry["handle"]).startswith(b"mltuner-memfd:")
    nodes[0].open_cuda_ipc_peer(1, bytes.fromhex(entries[1][0]["handle"]), 1 << 20)
    nodes[0].enable_cuda_ipc_peer(1)
    assert nodes[0].cuda_ipc_peers == [1] and nodes[0].cuda_ipc_same_device_peers == []
    # Another process's handle that names a file which is not its region (or
    # not a CPU engine's handle at all) is refused, and the pair keeps host frames.
    real = bytes.fromhex(entries[1][0]["handle"])
    forged = real[:-1] + (b"1" if real.endswith(b"0") else b"0")  # its random name, one digit off
    for handle in (forged, b"\x01" * 64):
        with pytest.raises(InvalidArgumentError):
            nodes[1].open_cuda_ipc_peer(0, handle, 1 << 20)
    with pytest.raises(InvalidArgumentError, match="bytes"):  # more than the peer exported
        nodes[1].open_cuda_ipc_peer(0, bytes.fromhex(entries[0][0]["handle"]), 2 << 20)
    with pytest.raises(InvalidArgumentError):
        nodes[1].enable_cuda_ipc_peer(0)
    for node in nodes:
        node.shutdown()


def test_an_engine_without_peers_or_the_setting_offers_no_export() -> None:
    alone = _core.ProcessNode(mltuner.Config().to_core(), 0, 1)
    assert _cuda_ipc.export(alone, "cpu", True, 1 << 20) == (None, "a job of one process")
    alone.shutdown()
    node = _core.ProcessNode(mltuner.Config().to_core(), 0, 2)
    entry, why = _cuda_ipc.export(node, "cpu", False, 1 << 20)
    assert entry is None and "turned off" in why
    assert _cuda_ipc.export(node, "tpu", True, 1 << 20) == (None, "a tpu engine")
    with pytest.raises(InvalidArgumentError):
        node.enable_cuda_ipc_peer(1)
    assert node.cuda_ipc_peers == []
    assert node.device_total_bytes == -1  # host memory has no fixed size: the region takes its default
    node.shutdown()


def test_malformed_cards_are_refused() -> None:
    base: dict[str, Any] = {"host": "h", "tcp": {"data": "tcp://1.2.3.4:5"}, "ipc": {}}
    assert Card.from_json(base, 1).cuda_ipc is None
    real_size = "ab" * (64 + 32 * 64)  # a memory handle and 32 event handles
    good = dict(base, cuda_ipc={"handle": real_size, "slice_bytes": 1 << 20})
    assert Card.from_json(good, 1).cuda_ipc == {"handle": real_size, "slice_bytes": 1 << 20}
    assert Card.from_json(good, 1).to_json() == good
    too_long = "a" * (MAX_CUDA_IPC_HANDLE_HEX + 1)
    for entry in ("x", {"handle": 5, "slice_bytes": 1}, {"handle": "ab", "slice_bytes": 0},
                  {"handle": "ab", "slice_bytes": True}, {"handle": too_long, "slice_bytes": 256},
                  {"handle": "ab", "slice_bytes": 1 << 51}):
        with pytest.raises(InvalidArgumentError, match="CUDA IPC"):
            Card.from_json(dict(base, cuda_ipc=entry), 1)


class _FakeNode:
    """What connect() calls on a node; opening fails for the ranks in ``refuse``."""

    def __init__(self, rank: int, refuse: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.rank = rank
        self.refuse = refuse
        self.opened: list[tuple[int, bytes, int]] = []
        self.enabled: list[int] = []

    def open_cuda_ipc_peer(self, peer: int, handle: bytes, slice_bytes: int) -> None:
        if peer in self.refuse:
            raise MltunerError("cudaIpcOpenMemHandle failed (a test's refusal)")
        self.opened.append((peer, handle, slice_bytes))

    def enable_cuda_ipc_peer(self, peer: int) -> None:
        self.enabled.append(peer)

    @property
    def cuda_ipc_same_device_peers(self) -> list[int]:
        return []


def _card(host: str, ipc: bool = True) -> Card:
    return Card(host=host, tcp={}, ipc={}, cuda_ipc={"handle": "0a0b", "slice_bytes": 512} if ipc else None)


def test_a_pair_uses_cuda_ipc_only_where_both_sides_opened_the_other() -> None:
    # Ranks 0-2 on host A (rank 2 cannot open rank 0's export), rank 3 on host B.
    cards = [_card("A"), _card("A"), _card("A"), _card("B")]
    nodes = [_FakeNode(0), _FakeNode(1), _FakeNode(2, refuse={0}), _FakeNode(3)]
    opened: dict[int, list[int]] = {}
    results: dict[int, dict[int, str]] = {}

    # connect() runs on every rank; the allgather gives each what all opened.
    # Phase 1 (opening) is the same whatever the gather returns, so run each
    # rank once with a gather that records, then again with the full answer.
    for rank, node in enumerate(nodes):
        def record(name: str, value: Any, rank: int = rank) -> list[Any]:
            opened[rank] = value
            return [[] for _ in cards]
        _cuda_ipc.connect(_FakeNode(rank, node.refuse), "cuda", cards[rank], cards, "", record)  # type: ignore[arg-type]
    for rank, node in enumerate(nodes):
        results[rank] = _cuda_ipc.connect(node, "cuda", cards[rank], cards, "", lambda name, value: [opened[r] for r in range(4)])  # type: ignore[arg-type]
    assert opened == {0: [1, 2], 1: [0, 2], 2: [1], 3: []}
    assert nodes[0].enabled == [1] and nodes[1].enabled == [0, 2] and nodes[2].enabled == [1] and nodes[3].enabled == []
    assert nodes[0].opened[0] == (1, b"\x0a\x0b", 512)
    assert results[0] == {1: "cuda-ipc", 2: "host-frames (the peer could not open this process's export)",
                          3: "host-frames (another host)"}
    assert results[2][0].startswith("host-frames (opening its export failed: cudaIpcOpenMemHandle failed")
    assert results[3] == {r: "host-frames (another host)" for r in range(3)}


def test_without_any_export_nobody_gathers() -> None:
    cards = [_card("A", ipc=False), _card("A", ipc=False)]

    def gather(name: str, value: Any) -> list[Any]:
        raise AssertionError("no rank offers CUDA IPC: no exchange")

    paths = _cuda_ipc.connect(_FakeNode(0), "cpu", cards[0], cards, "turned off", gather)  # type: ignore[arg-type]
    assert paths == {1: "host-frames (turned off)"}


@pytest.mark.parametrize("frame0", [
    _notice(1, 0, 0, 32),                      # well formed, but this node exported nothing
    _notice(1, 0, 1 << 62, 32),                # far outside any region
    _notice(1, 0, 0, 36),                      # not the size of the rows it announces
    _notice(1, 1, 0, 32),                      # for another rank
    _notice(0, 0, 0, 32),                      # from itself
    _notice(1, 0, 0, 32, event=32),            # names a copy event the sender does not have
    _header(_RELEASE, 1, 0, text=24) + _span(0, 32),   # releases nothing this node sent
    _header(_NOTICE, 1, 0, text=24) + _span(0, 32),    # a notice without its message
    _header(_RELEASE, 1, 0, text=28) + _span(0, 32),   # shorter than its header says
    _header(_RELEASE, 1, 0, text=16) + _span(0, 32)[:16],  # a span of the old 16 bytes
])
def test_a_node_refuses_notices_it_cannot_check(frame0: bytes) -> None:
    node = _core.ProcessNode(mltuner.Config(wait_timeout_s=1).to_core(), 0, 2)
    try:
        with pytest.raises(CorruptMessageError):
            node.deliver(frame0, b"")
        assert node.rejected_messages == 1
    finally:
        node.shutdown()


def test_a_notice_with_a_payload_frame_is_refused() -> None:
    node = _core.ProcessNode(mltuner.Config(wait_timeout_s=1).to_core(), 0, 2)
    try:
        with pytest.raises(CorruptMessageError, match="payload frame"):
            node.deliver(_notice(1, 0, 0, 32), b"\0" * 32)
    finally:
        node.shutdown()
