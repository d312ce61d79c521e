"""Dataclasses that declare their fields twice agree with themselves.

A dataclass compiled by mypyc keeps its generated ``__init__``, which runs as Python, so
the hot ones (``SchedulerOutput``, ``StepCost``, ...) also spell out an ``__init__`` by
hand. Nothing in Python checks the two declarations against each other: a field added to
the class body but not to ``__init__`` is simply never set (an ``AttributeError`` much
later, or a stale class default read as if it were the value). This test reads the
sources with ``ast``, so it checks the compiled and the interpreted build alike.

For every ``@dataclass`` class with its own ``__init__``: the parameters after ``self``
are the class body's fields (annotated, not ``ClassVar``), in order, with the same
annotations; a field without a default takes a parameter without one, a plain default is
the same expression, and a ``default_factory`` field defaults to ``None`` (the hand-written
body makes the fresh container); and the body assigns every field to ``self.<field>`` from
its parameter.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


@dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr
    default: ast.expr | None
    factory: ast.expr | None  # the default_factory= of a field(...) default


@dataclass(frozen=True)
class Mismatch:
    where: str  # "path:Class"
    field: str
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.problem}"


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass")


def _is_classvar(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    return (isinstance(annotation, ast.Name) and annotation.id == "ClassVar") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "ClassVar")


def _field_call(value: ast.expr | None) -> ast.Call | None:
    if isinstance(value, ast.Call):
        func = value.func
        if (isinstance(func, ast.Name) and func.id == "field") or (
                isinstance(func, ast.Attribute) and func.attr == "field"):
            return value
    return None


def _body_fields(cls: ast.ClassDef) -> list[Field]:
    fields = []
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        if _is_classvar(stmt.annotation):
            continue
        default, factory = stmt.value, None
        call = _field_call(stmt.value)
        if call is not None:
            keywords = {k.arg: k.value for k in call.keywords}
            default, factory = keywords.get("default"), keywords.get("default_factory")
        fields.append(Field(stmt.target.id, stmt.annotation, default, factory))
    return fields


def _empty_of(factory: ast.expr, value: ast.expr) -> bool:
    """Whether ``value`` is what ``factory()`` makes: ``F()``, or ``{}``/``[]`` for dict/list."""
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        return ast.dump(value.func) == ast.dump(factory)
    if isinstance(factory, ast.Name):
        if factory.id == "dict":
            return isinstance(value, ast.Dict) and not value.keys
        if factory.id == "list":
            return isinstance(value, ast.List) and not value.elts
    return False


def _accepted_annotations(f: Field) -> set[str]:
    """The field's annotation; a default_factory field's parameter is ``<annotation> | None``."""
    if f.factory is None:
        return {ast.dump(f.annotation)}
    return {ast.dump(ast.BinOp(f.annotation, ast.BitOr(), ast.Constant(None)))}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _self_assignments(init: ast.FunctionDef) -> dict[str, ast.expr]:
    """``self.<name> = <value>`` statements at the top of ``__init__``'s body."""
    assigned = {}
    for stmt in init.body:
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                assigned[target.attr] = value
    return assigned


def check_class(cls: ast.ClassDef, where: str, inherited: list[Field] | None = None) -> list[Mismatch]:
    """Each way ``cls``'s hand-written ``__init__`` disagrees with its class body."""
    init = next(s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__")
    fields = [*(inherited or []), *_body_fields(cls)]
    problems: list[Mismatch] = []
    args = init.args
    if args.vararg or args.kwarg:
        problems.append(Mismatch(where, "__init__", "takes *args or **kwargs"))
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if not params or params[0].arg != "self":
        return [*problems, Mismatch(where, "__init__", "has no self")]
    params = params[1:]
    positional = [*args.posonlyargs, *args.args][1:]
    # Defaults right-align with the positional parameters; keyword-only ones have their own.
    defaults: dict[str, ast.expr | None] = {p.arg: None for p in params}
    for p, d in zip(positional[len(positional) - len(args.defaults):], args.defaults):
        defaults[p.arg] = d
    for p, d in zip(args.kwonlyargs, args.kw_defaults):
        defaults[p.arg] = d

    by_name = {p.arg: p for p in params}
    field_names = [f.name for f in fields]
    for name in field_names:
        if name not in by_name:
            problems.append(Mismatch(where, name, "a field that __init__ does not take"))
    for name in by_name:
        if name not in field_names:
            problems.append(Mismatch(where, name, "an __init__ parameter that is no field"))
    common = [n for n in field_names if n in by_name]
    if common != [n for n in by_name if n in field_names]:
        problems.append(Mismatch(where, "__init__", f"parameters in another order than the fields {common}"))

    assigned = _self_assignments(init)
    for f in fields:
        param = by_name.get(f.name)
        if param is None:
            continue
        if param.annotation is None or ast.dump(param.annotation) not in _accepted_annotations(f):
            problems.append(Mismatch(where, f.name, "annotated differently in __init__"))
        default = defaults[f.name]
        if f.factory is not None:
            if not (isinstance(default, ast.Constant) and default.value is None):
                problems.append(Mismatch(where, f.name, "a default_factory field whose parameter does not default to None"))
        elif f.default is None:
            if default is not None:
                problems.append(Mismatch(where, f.name, "no default in the class body, one in __init__"))
        elif default is None or ast.dump(default) != ast.dump(f.default):
            problems.append(Mismatch(where, f.name, "a default in __init__ other than the class body's"))
        value = assigned.get(f.name)
        if value is None:
            problems.append(Mismatch(where, f.name, "never assigned to self in __init__"))
        elif f.name not in _names(value):
            problems.append(Mismatch(where, f.name, "assigned from something other than its parameter"))
        elif f.factory is not None and not _factory_fallback(value, f.name, f.factory):
            problems.append(Mismatch(where, f.name, "None does not become what its default_factory makes"))
    return problems


def _factory_fallback(value: ast.expr, name: str, factory: ast.expr) -> bool:
    """``F() if name is None else name`` or ``name if name is not None else F()``."""
    if not isinstance(value, ast.IfExp):
        return False
    test = value.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)
            and test.left.id == name and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        return False
    if isinstance(test.ops[0], ast.Is):
        fresh, given = value.body, value.orelse
    elif isinstance(test.ops[0], ast.IsNot):
        given, fresh = value.body, value.orelse
    else:
        return False
    return isinstance(given, ast.Name) and given.id == name and _empty_of(factory, fresh)


def check_source(source: str, path: str) -> tuple[list[str], list[Mismatch]]:
    """The redeclared dataclasses of one module, and every mismatch among them."""
    tree = ast.parse(source)
    dataclasses = {n.name: n for n in ast.walk(tree)
                   if isinstance(n, ast.ClassDef) and any(_is_dataclass_decorator(d) for d in n.decorator_list)}
    found, problems = [], []
    for cls in dataclasses.values():
        if not any(isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in cls.body):
            continue
        # Fields of a dataclass base declared in the same module come first, as dataclasses orders them.
        inherited: list[Field] = []
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in dataclasses:
                inherited += _body_fields(dataclasses[base.id])
        where = f"{path}:{cls.name}"
        found.append(where)
        problems += check_class(cls, where, inherited)
    return found, problems


def _package_sources() -> list[Path]:
    return sorted({p for folder in PACKAGE_DIRS.values() for p in (REPO / folder).rglob("*.py")})


def test_every_redeclared_dataclass_has_the_same_fields_in_both_declarations():
    found, problems = [], []
    for path in _package_sources():
        f, p = check_source(path.read_text(), str(path.relative_to(REPO)))
        found += f
        problems += p
    # The scan must see the known ones, or an empty scan would pass.
    for known in ("sim/core/scheduler_output.py:SchedulerOutput", "sim/replay/cost_model.py:StepCost",
                  "sim/core/engine_stats.py:EngineStats", "sim/core/offload/connector_metadata.py:OffloadingConnectorMetadata"):
        assert known in found, f"{known} not found among {found}"
    assert not problems, "\n".join(map(str, problems))


GOOD = '''
from dataclasses import dataclass, field

@dataclass(slots=True)
class Out:
    tokens: dict[str, int] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    total: float = 0.0
    name: str | None = None

    def __init__(self, tokens: dict[str, int] | None = None, ids: list[str] | None = None,
                 total: float = 0.0, name: str | None = None):
        self.tokens = {} if tokens is None else tokens
        self.ids = ids if ids is not None else list()
        self.total = total
        self.name = name
'''


def _mismatches(source: str) -> list[tuple[str, str]]:
    found, problems = check_source(source, "m.py")
    assert found == ["m.py:Out"]
    return [(p.where, p.field) for p in problems]


def test_the_check_passes_a_class_whose_declarations_agree():
    assert _mismatches(GOOD) == []


def test_the_check_names_the_class_and_field_of_each_mismatch():
    # A field added to the class body only.
    added = GOOD.replace("    name: str | None = None\n", "    name: str | None = None\n    late: int = 0\n")
    assert _mismatches(added) == [("m.py:Out", "late")]
    # A parameter that is no field, and a field that is not taken.
    renamed = GOOD.replace("name: str | None = None):", "label: str | None = None):").replace(
        "self.name = name", "self.name = label")
    assert sorted(_mismatches(renamed)) == [("m.py:Out", "label"), ("m.py:Out", "name")]
    # Another default.
    assert _mismatches(GOOD.replace("total: float = 0.0, name", "total: float = 1.0, name")) == [("m.py:Out", "total")]
    # Not assigned, or assigned from another parameter.
    assert _mismatches(GOOD.replace("        self.total = total\n", "")) == [("m.py:Out", "total")]
    assert _mismatches(GOOD.replace("self.total = total", "self.total = 0.0")) == [("m.py:Out", "total")]
    # Another annotation.
    assert _mismatches(GOOD.replace("total: float = 0.0,", "total: int = 0.0,")) == [("m.py:Out", "total")]
    # A default_factory field whose None makes the wrong container.
    assert _mismatches(GOOD.replace("{} if tokens is None", "[] if tokens is None")) == [("m.py:Out", "tokens")]
    # Fields swapped in __init__.
    swapped = GOOD.replace("total: float = 0.0, name: str | None = None)", "name: str | None = None, total: float = 0.0)")
    assert _mismatches(swapped) == [("m.py:Out", "__init__")]
