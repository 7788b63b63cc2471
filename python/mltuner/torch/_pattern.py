"""Held reads or reading again: the words for the access pattern that
:meth:`ClockDriver.prepare_plan <mltuner.torch._plan.Planning.prepare_plan>`
chose, and for a budget that neither pattern fits.

Held reads keep every layer's forward read open until its update, so the
engine's access-buffer pool holds the whole model once per clock in flight;
reading again (GeePS) posts each read after the layer's forward and reads
the rows again for its backward pass, so the pool holds about two layers'
working set. ``least`` maps each pattern tried (True: held) to its least
pool, the smallest ``Config.device_memory_budget`` the engine accepts.
"""

from __future__ import annotations

__all__ = ["reason", "refusal"]


def reason(given: bool | None, store_activations: bool, hold: bool, least: dict[bool, int], budget: int,
           swaps: tuple[int, int] | None = None) -> str:
    """Which pattern the plan uses, and why, in words (``PSModule.plan``).
    ``swaps``: the bytes a clock of each pattern (held, reading again) moves
    over the host link, where held reads fit but reading again moved fewer."""
    if given is not None:
        return f"hold_reads={hold} (given to wrap())"
    if store_activations:
        return "hold_reads=False (store_activations: each layer is read again for its backward pass)"
    if budget == 0:
        return "hold_reads=True (no Config.device_memory_budget)"
    if hold:
        return (f"hold_reads=True (the device_memory_budget of {budget} bytes holds the {least[True]} bytes of "
                "access-buffer pool that held reads need)")
    if swaps is not None:
        return (f"hold_reads=False (the device_memory_budget of {budget} bytes holds the {least[True]} bytes of "
                f"access-buffer pool that held reads need, but then swaps {swaps[0]} bytes a clock over the host "
                f"link; reading each layer again for its backward pass needs {least[False]} bytes of pool and "
                f"swaps {swaps[1]})")
    return (f"hold_reads=False (the device_memory_budget of {budget} bytes is below the {least[True]} bytes of "
            f"access-buffer pool that held reads need; reading each layer again for its backward pass needs "
            f"{least[False]} bytes)")


def refusal(given: bool | None, least: dict[bool, int], budget: int, prefetch_clocks: int | None) -> str:
    """The message of a budget too small for the pattern given (or, choosing,
    for either): the bytes each needs, and the budget. ``prefetch_clocks``
    is Config's; None (the plan chooses) refuses only a budget below one
    region's least pool, which ``least`` then holds."""
    if prefetch_clocks is None:
        pool = ("the access-buffer pool: 1 region (Config.prefetch_clocks=None takes one, prefetch_clocks 0, "
                "when the budget cannot hold two), holding a clock's buffers packed by lifetime")
    else:
        regions = 1 + prefetch_clocks
        pool = (f"the access-buffer pool: {regions} region{'s' if regions > 1 else ''}, one per clock in flight "
                "(1 + prefetch_clocks), each holding a clock's buffers packed by lifetime")
    if given is True:
        other = least[False]
        advice = (f"without hold_reads (unset, or False) each layer's rows are read again for its backward "
                  f"pass, which needs {other} bytes" if other <= budget else
                  f"even reading each layer again for its backward pass (hold_reads=False) needs {other} bytes")
        return (f"wrap(hold_reads=True) needs a Config.device_memory_budget of at least {least[True]} bytes "
                f"({pool}; held reads keep each layer's parameters there from its forward read to its "
                f"update), but the budget is {budget} bytes; {advice}")
    held = f"; holding reads would need {least[True]} bytes" if True in least else ""
    return (f"Config.device_memory_budget of {budget} bytes is too small for this model: it needs at least "
            f"{least[False]} bytes with each layer read for its forward pass and again for its backward pass "
            f"(hold_reads=False; {pool}){held}")
