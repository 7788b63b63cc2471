"""Shared helpers of the PyTorch adapter's tests.

torch is an optional extra: every test module here starts with
``pytest.importorskip("torch")``, so the directory is skipped cleanly
without it; this file imports torch only inside fixtures.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# test_keep imports test_recompute's models and training loop (pytest runs
# with --import-mode=importlib, which does not put test folders on sys.path).
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the workers of a LocalCluster already run on
    threads of their own, the machine may have two cores, and a fixed thread
    count keeps torch's reductions in the same order from run to run."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def max_rel_error(got: Any, want: Any) -> float:
    """The largest norm-wise relative error (max |got - want| / max |want|)
    over the tensors of two state dicts with the same keys."""
    import torch

    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    worst, worst_name = 0.0, ""
    for name, reference in want.items():
        if not torch.is_floating_point(reference):
            assert torch.equal(got[name].cpu(), reference.cpu()), name
            continue
        reference = reference.detach().double().cpu()
        scale = float(reference.abs().max())
        assert scale > 0, f"{name} is all zero: the comparison would prove nothing"
        error = float((got[name].detach().double().cpu() - reference).abs().max()) / scale
        if error > worst:
            worst, worst_name = error, name
    if worst > 1e-6:
        print(f"max_rel_error: worst tensor {worst_name!r}: {worst:.3g}")  # shown when a test fails
    return worst


@pytest.fixture(name="max_rel_error")
def max_rel_error_fixture() -> Any:
    """:func:`max_rel_error` (test modules get helpers through fixtures under
    --import-mode=importlib)."""
    return max_rel_error


@pytest.fixture
def stores_as_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """wrap() without its keep step (mltuner/torch/_keep.py): every stored
    activation stays in the engine's local table where the plan put it, for
    tests of the placement of stored activations itself."""
    from mltuner.torch import _keep

    monkeypatch.setattr(_keep.KeepOnDevice, "_variants", lambda self, driver, current: [])


def moved(before: Any, after: Any) -> float:
    """The largest relative change of a parameter tensor between two
    modules of the same structure: proof that training did something."""
    import torch

    new = dict(after.named_parameters())
    with torch.no_grad():
        return max(float((new[n] - p).abs().max() / p.abs().max()) for n, p in before.named_parameters())


@pytest.fixture(name="moved")
def moved_fixture() -> Any:
    """:func:`moved`."""
    return moved
