"""The import plan: README's Layout lists the packages lowest first; no module imports from a package listed
below its own, and no modules import each other in a circle. A package whose entry lists its rooms
(subpackages; ``train/``) holds every module in one of them, and no module of a room imports from a room
listed below its own.

Every import statement is an edge, for the order and for circles alike: one inside a function, and one
under ``if TYPE_CHECKING:`` (a type one module needs from another is a dependency too: a circle of types is
broken by moving the type where it belongs, a Protocol or a dataclass in the lower module, not by hiding
the import). For the order, modules named in strings count too (``importlib``: the command list, PEP 562
exports, the model registry's built-in, the fault kinds' package): a package may not name one listed below
it either. For circles they do not: a name in a string is data the naming module holds (a table of
commands, exports or built-in plug-ins), and it reaches the module loaded by that name only through an
interface it declares itself (``register(sub)``, ``SPEC``, a ``FaultKind`` registering itself, the exported
name); the loaded module implements that interface, so it depends on the naming module, not the reverse
(the model registry, ``model/spec.py``, loads ``model/llama/spec.py`` by name; that module imports the
registry for ``ModelSpec``). Such a load runs only inside a function, on first use, never while the naming
module is imported (:func:`test_modules_named_in_strings_are_loaded_only_inside_functions`), so the naming
module is complete before the loaded one imports it."""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
MODULES = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
           for p in (SRC / "recover").rglob("*.py")}


def layout_block() -> str:
    return (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("```")[1]


def layout_order() -> list[str]:
    return re.findall(r"^  (\w+)(?:\.py|/) ", layout_block(), re.M)


def layout_rooms() -> dict[str, list[str]]:
    """Package -> its rooms (subpackages), lowest first: the lines ``   name/  text`` indented inside the
    package's entry of the Layout (``train/``); a package whose entry lists none is absent."""
    entries = re.split(r"^(?=  \S)", layout_block(), flags=re.M)
    found = {}
    for entry in entries:
        head, _, rest = entry.partition("\n")
        package = re.match(r"  (\w+)/ ", head)
        rooms = re.findall(r"^ {3,}(\w+)/ {2,}", rest, re.M)
        if package and rooms:
            found[package[1]] = rooms
    return found


def module_of(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path, strings: bool) -> set[str]:
    """The recover modules ``path`` imports: every import statement's (in a function or under
    ``TYPE_CHECKING`` too), and with ``strings`` those its string constants name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif strings and isinstance(node, ast.Constant) and re.fullmatch(r"recover(\.\w+)+", str(node.value)):
            found.add(node.value)
    return {module_of(name) for name in found if name.split(".")[0] == "recover"}


def test_no_package_imports_one_listed_below_it() -> None:
    rank = {unit: i for i, unit in enumerate(layout_order())}
    unit = {name: name.split(".")[1] for name in MODULES if name != "recover"}  # the root only re-exports api
    assert set(unit.values()) <= set(rank), f"missing from README's Layout: {set(unit.values()) - set(rank)}"
    upward = [f"{name} -> {dep}" for name, path in MODULES.items() for dep in imports(path, strings=True)
              if name in unit and dep in unit and rank[unit[dep]] > rank[unit[name]]]
    assert not upward, f"imports of a package listed below (README, Layout): {upward}"


def test_no_room_imports_one_listed_below_it() -> None:
    rooms = layout_rooms()
    assert "train" in rooms, "README's Layout: the train/ entry lists its rooms (lines '   name/  text')"
    for package, order in rooms.items():
        prefix = f"recover.{package}."
        inside = {name: name.split(".")[2] for name in MODULES if name.startswith(prefix)}
        loose = [name for name in inside if name.count(".") == 2 and MODULES[name].name != "__init__.py"]
        assert not loose, f"modules of {package}/ outside its rooms: {loose}"
        assert set(inside.values()) == set(order), f"{package}/'s rooms in README's Layout: {order}, " \
            f"its subpackages: {sorted(set(inside.values()))}"
        rank = {room: i for i, room in enumerate(order)}
        upward = [f"{name} -> {dep}" for name in inside for dep in imports(MODULES[name], strings=True)
                  if dep in inside and rank[inside[dep]] > rank[inside[name]]]
        assert not upward, f"imports of a room of {package}/ listed below (README, Layout): {upward}"


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = {name: imports(path, strings=False) - {name} for name, path in MODULES.items()}
    tuple(graphlib.TopologicalSorter(graph).static_order())  # CycleError names the circle


def test_modules_named_in_strings_are_loaded_only_inside_functions() -> None:
    loads = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        deferred = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(node)}
        loads += [f"{name}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and re.search(r"(^|\.)(import_module|__import__)$", ast.unparse(node.func))
                  and id(node) not in deferred]
    assert not loads, f"modules loaded by name while their namer is imported (load them on first use): {loads}"
