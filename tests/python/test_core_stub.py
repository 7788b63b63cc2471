"""The hand-written stub _core.pyi must name exactly what the compiled module
exposes: stubs drift silently otherwise."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mltuner
from mltuner import _core

STUB = Path(__file__).resolve().parents[2] / "python" / "mltuner" / "_core.pyi"
# Special methods that are part of the API (protocols), so the stub must list them.
PROTOCOL_METHODS = {"__init__", "__dlpack__", "__dlpack_device__"}


def _stub_names() -> dict[str, set[str]]:
    """Top-level names of the stub, each with the member names of its class."""
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            names[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = set()
    return names


def _module_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for name, value in vars(_core).items():
        if name.startswith("_"):
            continue
        if inspect.isclass(value):
            members = {m for m in vars(value) if not m.startswith("_") or m in PROTOCOL_METHODS}
            if "__init__" in members and value.__init__ is object.__init__:
                members.discard("__init__")
            # pybind11 enums carry helper attributes; the stub lists values only.
            if hasattr(value, "__members__"):
                members = set(value.__members__) | {"name", "value"}
            names[name] = members
        elif callable(value):
            names[name] = set()
    return names


def test_stub_lists_every_module_name() -> None:
    assert set(_stub_names()) == set(_module_names())


def test_stub_lists_every_member() -> None:
    stub, module = _stub_names(), _module_names()
    for name in module:
        # Constructors pybind11 adds to classes without py::init are not callable.
        assert stub[name] - {"__init__"} == module[name] - {"__init__"}, name


def test_the_stub_ships_with_the_package() -> None:
    assert (Path(mltuner.__file__).parent / "_core.pyi").exists()
