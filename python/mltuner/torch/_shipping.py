"""When a clock's updates leave: from the backward pass, layer by layer as
each layer's gradients are final (wait-free backpropagation), or all at
:meth:`PSModule.step <mltuner.torch.PSModule.step>` in one engine call.

Shipping from the backward pass hides a transfer behind the layers still to
compute, at a price paid on autograd's thread: a Python hook per parameter
and an engine call per layer. That pays only where all three hold:

- some shard lives in another process (``Worker.shards_in_process`` is
  False): within one process an update never crosses a socket, so there is
  nothing to hide;
- the backward pass runs on a GPU (``Config.device == "cuda"``), which
  computes while the host threads move bytes. On a CPU worker the backward
  pass, the engine's threads and the transport's share the same cores and
  one GIL: shipping early moves the same work into the backward pass instead
  of overlapping it, and adds the hooks. Measured on the MNIST-1D CNN with 2
  CPU processes, shipping at step() took 11-23% less time per clock, 17-19%
  less CPU and 10% fewer context switches, at slack 0 and 3 alike;
- some peer takes host frames (another host, or no CUDA IPC between the
  two processes: ``Worker.peers_by_cuda_ipc`` is False), so that a transfer
  takes milliseconds. Where every peer is reached by CUDA IPC, the transfer
  is a device-to-device copy of a fraction of a millisecond and the hooks
  cost more than it: ResNet-18 on two H200s (batch 128 per GPU) reached
  1.08-1.10 of DDP's throughput shipping at step() and 0.84-0.94 shipping
  from the backward pass, alternated twice in one sitting.

docs/torch.md, "When updates leave", has the tables;
``benchmarks/throughput_bench.py --overlap step|backward`` measures it on
any machine.
"""

from __future__ import annotations

from mltuner.client._worker import Worker

__all__ = ["choose_overlap"]


def choose_overlap(worker: Worker, given: bool | None) -> tuple[bool, str]:
    """Whether to ship each layer's update from the backward pass, and why,
    in words (``PSModule.plan``): as ``given``, else by the rule of the
    module docstring."""
    if given is not None:
        when = "from the backward pass" if given else "at step()"
        return bool(given), f"overlap_updates={bool(given)} (given to wrap(): updates ship {when})"
    if worker.shards_in_process:
        return False, ("overlap_updates=False (every shard is in this process: no transfer to hide; updates ship "
                       "at step())")
    if worker.config.device != "cuda":
        return False, ("overlap_updates=False (a CPU worker: the backward pass and the transfer share the cores "
                       "and the GIL; updates ship at step())")
    if worker.peers_by_cuda_ipc:
        return False, ("overlap_updates=False (a GPU worker whose peers all take CUDA IPC: a device-to-device "
                       "copy costs less than the backward pass's hooks; updates ship at step())")
    return True, ("overlap_updates=True (a GPU worker with a shard in another process reached through host "
                  "frames: each layer's update ships from the backward pass while the layers below compute)")
