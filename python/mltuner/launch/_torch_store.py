"""Meeting through torchrun's own store.

torchrun's agent serves a TCPStore on ``MASTER_ADDR:MASTER_PORT`` and tells
its workers so (``TORCHELASTIC_USE_AGENT_STORE=True``). That port is taken,
so rank 0 binds its rendezvous socket on a free port and publishes
``host:port`` in the store under the run's key; every rank reads it from
there. torch is imported only here, and only under torchrun, where it is
installed by definition.
"""

from __future__ import annotations

import collections
import datetime
import threading
from typing import Any

from mltuner.exceptions import InvalidArgumentError, WaitTimeoutError

__all__ = ["job_key", "publish_address", "lookup_address"]

_jobs_opened: collections.Counter[str] = collections.Counter()
_jobs_lock = threading.Lock()


def job_key(run_key: str) -> str:
    """The key of this process's next job in the run. A script may open jobs
    one after another (every rank in the same order); with one key a rank
    could read the previous job's address, whose coordinator is closing."""
    with _jobs_lock:
        number = _jobs_opened[run_key]
        _jobs_opened[run_key] += 1
    return f"{run_key}/job-{number}"


def _connect(host: str, port: int, timeout_s: float) -> Any:
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch's stubs omit it
    except ImportError as error:  # pragma: no cover - torchrun implies torch
        raise InvalidArgumentError(f"TORCHELASTIC_USE_AGENT_STORE is set but torch cannot be imported to reach "
                                   f"torchrun's store: {error}") from None
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, TimeoutError, OSError) as error:
        raise WaitTimeoutError(f"could not reach torchrun's store at {host}:{port} (MASTER_ADDR, MASTER_PORT) "
                               f"within {timeout_s:g} s: {error}") from None


def publish_address(host: str, port: int, key: str, address: str, timeout_s: float) -> None:
    """Rank 0: stores ``address`` (``host:port`` of its rendezvous socket)."""
    store = _connect(host, port, timeout_s)
    try:
        store.set(key, address)
    except (RuntimeError, OSError) as error:
        raise WaitTimeoutError(f"could not write the rendezvous address to torchrun's store at "
                               f"{host}:{port}: {error}") from None


def lookup_address(host: str, port: int, key: str, timeout_s: float) -> tuple[str, int]:
    """Every rank: rank 0's rendezvous address, waiting up to ``timeout_s``
    for rank 0 to publish it."""
    store = _connect(host, port, timeout_s)
    try:
        raw = store.get(key)
    except (RuntimeError, TimeoutError, OSError) as error:
        raise WaitTimeoutError(f"rank 0 did not publish its rendezvous address in torchrun's store at "
                               f"{host}:{port} within {timeout_s:g} s (did rank 0 fail to start?): "
                               f"{error}") from None
    text = bytes(raw).decode(errors="replace")
    address, _, port_text = text.rpartition(":")
    if not address or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgumentError(f"torchrun's store holds {text!r} under {key!r}, not a host:port")
    return address.strip("[]"), int(port_text)
