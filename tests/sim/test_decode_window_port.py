"""A decode window reaches the engine only through its declared port (``decode_window.py``:
``WindowScheduler``, ``WindowKVCacheManager``, ``WindowEngine``; docs/architecture.md#decode-windows).

Parsed, not run: in the window's modules every reference typed as a port (a parameter or
``self`` attribute annotated with a port, or a name bound to one) may only have a port
method called on it, and no statement assigns or deletes an attribute of anything but
``self``. Then every port method is implemented, with the same parameters, by the class
that stands behind it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kvtwin.sim.core import decode_window
from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.kv_cache_manager import KVCacheManager

CORE = Path(__file__).resolve().parents[2] / "sim" / "core"
# The window's modules that hold references to the engine's objects (``window_members`` and
# ``window_pricing`` hold none).
WINDOW_MODULES = ("decode_window.py", "window_opening.py", "windowed_batch_queue.py")
# The classes behind the port, which the window's modules may neither import nor name.
CONCRETE = ("Scheduler", "AsyncScheduler", "KVCacheManager", "KVCacheCoordinator", "EngineCore")
PORTS = {"WindowScheduler": AsyncScheduler, "WindowKVCacheManager": KVCacheManager, "WindowEngine": EngineCore}


def _protocol_methods(source: str) -> dict[str, set[str]]:
    """Each port Protocol's method names, read from ``decode_window.py``."""
    methods: dict[str, set[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in PORTS:
            methods[node.name] = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    return methods


def _annotation_port(annotation: ast.expr | None) -> str | None:
    """The port an annotation names (``WindowScheduler``, ``WindowScheduler | None``)."""
    if annotation is None:
        return None
    for node in ast.walk(annotation):
        name = node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
        if isinstance(name, str):
            for port in PORTS:
                if port in name.split():
                    return port
    return None


class _PortChecker(ast.NodeVisitor):
    """Collects the breaches of the port in one module."""

    def __init__(self, methods: dict[str, set[str]], file: str):
        self.methods = methods
        self.file = file
        self.breaches: list[str] = []
        self.self_ports: dict[str, str] = {}  # self attribute -> port
        self.local_ports: dict[str, str] = {}  # name in the function being visited -> port

    def _port_of(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.local_ports.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return self.self_ports.get(node.attr)
        return None

    def _breach(self, node: ast.AST, what: str) -> None:
        self.breaches.append(f"{self.file}:{node.lineno}: {what}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name in CONCRETE:
                self._breach(node, f"imports {alias.name}: the window knows the engine by its port")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in CONCRETE:
            self._breach(node, f"names {node.id}: the window knows the engine by its port")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name in PORTS:
            return  # the declaration itself
        self.self_ports = {}
        for item in ast.walk(node):  # self attributes annotated with a port, anywhere in the class
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Attribute)
                    and isinstance(item.target.value, ast.Name) and item.target.value.id == "self"):
                port = _annotation_port(item.annotation)
                if port is not None:
                    self.self_ports[item.target.attr] = port
        self.generic_visit(node)
        self.self_ports = {}

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer = self.local_ports
        self.local_ports = {}
        for arg in node.args.args + node.args.kwonlyargs:
            port = _annotation_port(arg.annotation)
            if port is not None:
                self.local_ports[arg.arg] = port
        self.generic_visit(node)
        self.local_ports = outer

    def visit_Assign(self, node: ast.Assign) -> None:
        port = self._port_of(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name) and port is not None:
                self.local_ports[target.id] = port  # an alias is held to the same port
        self._check_targets(node.targets)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name):
            port = _annotation_port(node.annotation) or (self._port_of(node.value) if node.value else None)
            if port is not None:
                self.local_ports[node.target.id] = port
        self._check_targets([node.target])
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_targets([node.target])
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._check_targets(node.targets)
        self.generic_visit(node)

    def _check_targets(self, targets: list[ast.expr]) -> None:
        for target in targets:
            for item in ast.walk(target):
                if (isinstance(item, ast.Attribute) and isinstance(item.ctx, (ast.Store, ast.Del))
                        and not (isinstance(item.value, ast.Name) and item.value.id == "self")):
                    self._breach(item, f"writes {ast.unparse(item)}, an attribute of another object")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            port = self._port_of(func.value)
            if port is not None:
                if func.attr not in self.methods[port]:
                    self._breach(node, f"calls {ast.unparse(func)}, not a method of {port}")
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    self.visit(arg)
                return
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # Reached only for attributes not called as a port method (``visit_Call``).
        port = self._port_of(node.value)
        if port is not None:
            self._breach(node, f"reads {ast.unparse(node)}, not a call of a {port} method")
        self.generic_visit(node)


def port_breaches(source: str, file: str, methods: dict[str, set[str]]) -> list[str]:
    checker = _PortChecker(methods, file)
    checker.visit(ast.parse(source))
    return checker.breaches


# The KV cache manager's side is a base class of its own module (``window_port.py``).
METHODS = _protocol_methods((CORE / "decode_window.py").read_text() + "\n" + (CORE / "window_port.py").read_text())


def test_the_port_is_declared():
    assert set(METHODS) == set(PORTS)
    assert all(METHODS.values())


@pytest.mark.parametrize("file", WINDOW_MODULES)
def test_the_window_touches_only_its_port(file: str):
    assert port_breaches((CORE / file).read_text(), file, METHODS) == []


def test_the_checker_finds_what_the_window_used_to_do():
    """The writes and reads the window made before its port, each a breach."""
    source = '''
class DecodeWindow:
    def __init__(self, scheduler: WindowScheduler):
        self.scheduler: WindowScheduler = scheduler
        self.kv_cache_manager: WindowKVCacheManager = scheduler.get_kv_cache_manager()

    def schedule(self, engine: WindowEngine | None):
        scheduler = self.scheduler
        self.reported, scheduler.finished_req_ids = scheduler.finished_req_ids, []
        scheduler.num_batches += 1
        scheduler.in_flight_partials.appendleft([])
        engine.batch_queue.append(None)
        self.kv_cache_manager.replaced_block_ids.pop("a", None)
        kv = self.kv_cache_manager
        kv.coordinator.managers
        request.num_computed_tokens = 3
        scheduler.update_from_output(scheduler.requests, {})
'''
    breaches = port_breaches(source, "old.py", METHODS)
    found = "\n".join(breaches)
    for what in ("writes scheduler.finished_req_ids", "reads scheduler.finished_req_ids",
                 "writes scheduler.num_batches", "reads scheduler.in_flight_partials",
                 "reads engine.batch_queue", "reads self.kv_cache_manager.replaced_block_ids",
                 "reads kv.coordinator", "writes request.num_computed_tokens", "reads scheduler.requests"):
        assert what in found, (what, found)
    # The port's own calls are not breaches.
    assert not any("update_from_output" in b or "get_kv_cache_manager" in b for b in breaches)


def test_the_window_before_its_port_breaks_it():
    """The window as it was (``git show d0fae04:sim/core/decode_window.py``), kept in
    miniature: its first breaches, line for line."""
    source = '''
class DecodeWindow:
    def __init__(self, scheduler: WindowScheduler):
        self.scheduler: WindowScheduler = scheduler
        self.kv_cache_manager: WindowKVCacheManager = scheduler.kv_cache_manager

    def _blocks_needed(self, request_id: str) -> int:
        managers = self.kv_cache_manager.coordinator.managers
        return sum(len(m.req_to_blocks[request_id]) for m in managers)
'''
    assert [b.split(": ", 1)[1] for b in port_breaches(source, "old.py", METHODS)] == [
        "reads scheduler.kv_cache_manager, not a call of a WindowScheduler method",
        "reads self.kv_cache_manager.coordinator, not a call of a WindowKVCacheManager method",
    ]


@pytest.mark.parametrize("port", sorted(PORTS))
def test_every_port_method_is_implemented_with_its_parameters(port: str):
    protocol = getattr(decode_window, port)
    implementation = PORTS[port]
    for name in sorted(METHODS[port]):
        declared = inspect.signature(getattr(protocol, name))
        implemented = getattr(implementation, name, None)
        assert callable(implemented), f"{implementation.__name__} lacks {port}.{name}"
        real = inspect.signature(implemented)
        declared_names = [p.name for p in declared.parameters.values()]
        real_names = [p.name for p in real.parameters.values()]
        # The implementation may take more, with defaults (``allocate_slots``' options).
        assert real_names[:len(declared_names)] == declared_names, (port, name, declared_names, real_names)
        extra = list(real.parameters.values())[len(declared_names):]
        assert all(p.default is not inspect.Parameter.empty for p in extra), (port, name, real_names)
