"""CUDA IPC between two processes on one GPU, and on two where the machine
has them: the path is taken, and the results equal those of the
pinned-host-frame path bit for bit.

Runs real processes on 127.0.0.1 (tests/python/gpu/cuda_ipc_worker.py), both
on GPU 0 or one on each of GPUs 0 and 1. Self-diagnosing: each worker prints the data path it chose per
peer and its transport counters, and a failure shows every worker's output
(including any cudaIpc* error that sent it to host frames).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import mltuner as mlt

pytestmark = pytest.mark.gpu

if mlt.cuda_device_count() == 0:
    pytest.skip(f"needs the CUDA backend and a visible GPU (built with CUDA: {mlt.cuda_built()}, "
                f"devices: {mlt.cuda_device_count()})", allow_module_level=True)
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from ipc_pair import launch_pair  # noqa: E402  (beside this file)


def run_pair(out: Path, cuda_ipc: bool, *args: str, timeout_s: float = 180.0, gpus: int = 1) -> list[dict]:
    """Two ranks, on GPU 0 or rank r on GPU r (``gpus``); returns each
    rank's json report plus its arrays and output. Raises with both outputs
    when a rank fails."""
    out.mkdir(parents=True, exist_ok=True)
    codes, outputs = launch_pair(out, cuda_ipc, list(args), timeout_s=timeout_s, gpus=gpus)
    report = "\n".join(f"--- rank {r} (exit {code}, cuda_ipc={cuda_ipc}) ---\n{o}"
                       for r, (code, o) in enumerate(zip(codes, outputs)))
    print(report)
    assert all(code == 0 for code in codes), report
    results = []
    for rank in range(2):
        result = json.loads((out / f"rank-{rank}.json").read_text())
        with np.load(out / f"rank-{rank}.npz") as arrays:
            result["arrays"] = dict(arrays)
        result["output"] = outputs[rank]
        results.append(result)
    return results


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=pytest.mark.skipif(
    mlt.cuda_device_count() < 2, reason="needs two GPUs"))])
def test_two_processes_take_cuda_ipc_and_match_host_frames(tmp_path: Path, gpus: int) -> None:
    """On one GPU, or one process on each of two (peer memory: NVLink or PCIe)."""
    ipc = run_pair(tmp_path / "ipc", True, "--clocks", "10", gpus=gpus)
    host = run_pair(tmp_path / "host", False, "--clocks", "10", gpus=gpus)
    for rank in range(2):
        peer = str(1 - rank)
        on, off = ipc[rank], host[rank]
        # The path taken, asserted from both the choice and the counters.
        assert on["data_paths"] == {peer: "cuda-ipc"}, on["output"]
        assert on["peers_by_cuda_ipc"] and not off["peers_by_cuda_ipc"]  # what wrap()'s shipping rule reads
        # Releases leave in order only to a peer on this GPU: one on another
        # GPU held every later message for its reads (the region's pointer
        # attributes name the importing GPU; the UUID in the handle does not).
        assert on["same_device_peers"] == ([1 - rank] if gpus == 1 else []), on["output"]
        assert on["stats"]["cuda_ipc_sent_bytes"] > 0 and on["stats"]["cuda_ipc_received_bytes"] > 0, on["stats"]
        assert on["stats"]["device_payload_bytes_by_host"] == 0, on["stats"]  # no fallback: every payload by IPC
        assert on["stats"]["cuda_ipc_fallbacks"] == 0, on["stats"]
        assert off["data_paths"][peer].startswith("host-frames (turned off"), off["output"]
        # Turned off, the engine stages device values in pinned host frames itself: all go by socket.
        assert off["stats"]["cuda_ipc_sent_bytes"] == 0 and off["stats"]["socket_payload_bytes"] > 0, off["stats"]
        assert on["stats"]["socket_payload_bytes"] < off["stats"]["socket_payload_bytes"] // 10, on["stats"]
        # What one sends by IPC, the other receives.
        assert on["stats"]["cuda_ipc_sent_bytes"] == ipc[1 - rank]["stats"]["cuda_ipc_received_bytes"]
        # Same bits by either path, every clock and at the end.
        for name in ("seen", "final_big", "final_small"):
            np.testing.assert_array_equal(on["arrays"][name], off["arrays"][name], err_msg=f"rank {rank} {name}")
        assert np.any(on["arrays"]["final_big"] != ipc[0]["arrays"]["seen"][0]), "training changed nothing"
    np.testing.assert_array_equal(ipc[0]["arrays"]["final_big"], ipc[1]["arrays"]["final_big"])


def test_a_clock_in_parts_by_cuda_ipc_matches_whole_host_frames(tmp_path: Path) -> None:
    """"big" (4096 x 64 floats: 512 KiB a shard) in parts of 64 KiB: eight
    updates and eight pushes a clock each way by IPC, each applied on its own;
    the same bits as whole payloads by host frames."""
    ipc = run_pair(tmp_path / "ipc", True, "--clocks", "8", "--part-bytes", str(64 << 10))
    host = run_pair(tmp_path / "host", False, "--clocks", "8", "--part-bytes", "0")
    for rank in range(2):
        on, off = ipc[rank], host[rank]
        assert on["stats"]["cuda_ipc_sent_bytes"] > 0 and on["stats"]["cuda_ipc_fallbacks"] == 0, on["stats"]
        # 16 pushes of "big" a clock where 2 went (and "small"'s 2 as before).
        assert on["messages_received"] > 3 * off["messages_received"], (on["messages_received"], off["messages_received"])
        for name in ("seen", "final_big", "final_small"):
            np.testing.assert_array_equal(on["arrays"][name], off["arrays"][name], err_msg=f"rank {rank} {name}")


def test_payloads_landing_in_a_crowded_slice_are_copied_out_and_still_match(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 256 KiB slice and "big" in parts of 64 KiB (eight updates and eight
    pushes a clock each way): past half of the slice held, a payload that
    lands is copied into pooled device memory on the receive stream and its
    range released; the same bits as whole payloads by host frames."""
    monkeypatch.setenv("MLTUNER_CUDA_IPC_SLICE_BYTES", str(256 << 10))
    ipc = run_pair(tmp_path / "ipc", True, "--clocks", "8", "--part-bytes", str(64 << 10))
    monkeypatch.delenv("MLTUNER_CUDA_IPC_SLICE_BYTES")
    host = run_pair(tmp_path / "host", False, "--clocks", "8", "--part-bytes", "0")
    for rank in range(2):
        stats = ipc[rank]["stats"]
        assert stats["cuda_ipc_copied_out_bytes"] > 0, stats
        assert stats["cuda_ipc_copied_out_bytes"] <= stats["cuda_ipc_received_bytes"], stats
        for name in ("seen", "final_big", "final_small"):
            np.testing.assert_array_equal(ipc[rank]["arrays"][name], host[rank]["arrays"][name],
                                          err_msg=f"rank {rank} {name}")


def test_payloads_larger_than_the_slice_fall_back_and_still_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 64 KiB slice: "small"'s payloads fit, "big"'s (512 KiB per shard) do not.
    monkeypatch.setenv("MLTUNER_CUDA_IPC_SLICE_BYTES", str(64 << 10))
    ipc = run_pair(tmp_path / "ipc", True, "--clocks", "6")
    monkeypatch.delenv("MLTUNER_CUDA_IPC_SLICE_BYTES")
    host = run_pair(tmp_path / "host", False, "--clocks", "6")
    for rank in range(2):
        stats = ipc[rank]["stats"]
        assert ipc[rank]["data_paths"] == {str(1 - rank): "cuda-ipc"}, ipc[rank]["output"]
        assert stats["cuda_ipc_sent_bytes"] > 0 and stats["cuda_ipc_fallbacks"] > 0, stats
        assert stats["device_payload_bytes_by_host"] > 0, stats
        for name in ("seen", "final_big", "final_small"):
            np.testing.assert_array_equal(ipc[rank]["arrays"][name], host[rank]["arrays"][name])
