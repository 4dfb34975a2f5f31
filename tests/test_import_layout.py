"""The package's import layout: no cycle between modules, no private name across packages.

Read with `ast`, never by importing: every `import a.b` and `from a import b`
(module level, inside functions, under `if TYPE_CHECKING:` too: a cycle that
only type checking walks is still two modules that each need the other),
relative ones resolved, and every `alias._name` attribute use where `alias`
is a module bound by one of those imports (or a class or function imported
from one: `Klass._name` takes `_name` from `Klass`'s module).

- An edge A -> B means module A imports module B (`from pkg import mod` is an
  edge to `pkg.mod` when that is a module, else to `pkg`). A cycle is a
  strongly connected set of two or more modules. Importing a submodule also
  runs its package's `__init__`, but that implicit edge is not counted: every
  package whose `__init__` re-exports a submodule would be a "cycle".
- A private name is one with a single leading underscore (`_x`, not `__x__`).
  It may be taken only by a module of the package that defines it (the same
  directory); taking it from another package, a parent or a child included,
  is a violation.

The last tests run the same checks on a small synthetic package with a cycle
(one edge inside a function) and private names taken both ways, so the
checks are known to fire.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import trtllm_mtp_carry

PACKAGE_ROOT = Path(trtllm_mtp_carry.__file__).resolve().parent


@dataclass(frozen=True)
class Use:
    """One private name a module takes from another: where, what, from which module."""

    module: str
    line: int
    source: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} takes {self.source}.{self.name}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (`pkg.sub.mod`, `pkg.sub` for an `__init__`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module's code lives in: itself for an `__init__`, else its parent."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, modules: dict[str, Path], level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    base = _package_of(module, modules).split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the package (None: not ours)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def scan(root: Path) -> tuple[dict[str, set[str]], list[Use]]:
    """The import graph of the package at `root` (module -> modules it imports) and
    every private name one module takes from another module."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    uses: list[Use] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        # a local name bound to one of our modules, or to a name one of them defines:
        # -> (that module, the name in it, "" for the module itself)
        aliases: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, modules)
                    if target is None:
                        continue
                    graph[module].add(target)
                    if alias.asname:
                        aliases[alias.asname] = (target, "")
                    else:  # `import a.b.c` binds `a`
                        top = alias.name.split(".")[0]
                        if top in modules:
                            aliases[top] = (top, "")
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, modules, node.level, node.module)
                if _owner(source, modules) is None:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        graph[module].add(submodule)
                        aliases[alias.asname or alias.name] = (submodule, "")
                        continue
                    owner = _owner(source, modules)
                    assert owner is not None
                    graph[module].add(owner)
                    if _private(alias.name):
                        uses.append(Use(module, node.lineno, owner, alias.name))
                    # a class or function of ours: `Name._x` is taken from its module too
                    aliases[alias.asname or alias.name] = (owner, alias.name)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain = _dotted(node.value)
            if chain is None or chain[0] not in aliases:
                continue
            source, name = aliases[chain[0]]
            if not name:  # `mod.sub._x`: the longest module prefix is the source
                full = ".".join([source, *chain[1:]])
                source = _owner(full, modules) or source
                name = full[len(source) + 1:]
            else:
                name = ".".join([name, *chain[1:]])
            uses.append(Use(module, node.lineno, source, f"{name}.{node.attr}" if name else node.attr))
        graph[module].discard(module)
    return graph, uses


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def foreign_private_uses(root: Path) -> list[Use]:
    """The private names a module takes from a module of another package."""
    modules = module_files(root)
    _, uses = scan(root)
    return [u for u in uses
            if _package_of(u.module, modules) != _package_of(u.source, modules)]


def test_the_package_has_no_import_cycle():
    graph, _ = scan(PACKAGE_ROOT)
    assert cycles(graph) == []


def test_no_module_takes_a_private_name_from_another_package():
    assert [str(u) for u in foreign_private_uses(PACKAGE_ROOT)] == []


def test_serving_imports_nothing_of_the_bench():
    # a served request's path never climbs into the benchmark (issue 24)
    graph, _ = scan(PACKAGE_ROOT)
    serving = ("trtllm_mtp_carry.serve", "trtllm_mtp_carry.trtllm")
    assert sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(serving)
                  for t in targets if t.startswith("trtllm_mtp_carry.bench")) == []


def external_imports(root: Path) -> dict[str, set[str]]:
    """Every module of the package at `root` -> the top-level names of the outside packages it imports
    (anywhere in it: inside functions and under `if TYPE_CHECKING:` too)."""
    modules = module_files(root)
    out: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            out[module].update(n.split(".")[0] for n in names if _owner(n, modules) is None)
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_core_imports_no_torch_numpy_or_triton():
    # the core is pure Python (its package docstring): the block book included
    heavy = {"torch", "numpy", "triton"}
    core = "trtllm_mtp_carry.core"
    assert "trtllm_mtp_carry.core.block_book" in module_files(PACKAGE_ROOT)
    assert {m: sorted(names & heavy) for m, names in external_imports(PACKAGE_ROOT).items()
            if m.startswith(core) and names & heavy} == {}
    graph, _ = scan(PACKAGE_ROOT)
    assert sorted(t for m in graph if m.startswith(core) for t in graph[m] if not t.startswith(core)) == []


def test_the_drafter_pool_sits_below_the_row_codecs():
    # the pool knows its own rows only: a codec writes the blocks `carry_in` hands out
    graph, _ = scan(PACKAGE_ROOT)
    codecs = {f"trtllm_mtp_carry.dataplane.{m}" for m in ("row_codec", "row_format", "nvfp4", "row_layout")}
    assert sorted(reachable(graph, "trtllm_mtp_carry.dataplane.kv_pool") & codecs) == []
    assert "trtllm_mtp_carry.dataplane.kv_pool" in reachable(graph, "trtllm_mtp_carry.runtime.carry_runtime")


def test_the_external_import_scan_sees_every_way_of_writing_one(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os.path\nfrom numpy import zeros\nfrom . import b\n"
                              "def f():\n    import torch.cuda\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import triton\n")
    assert external_imports(pkg) == {"pkg": set(), "pkg.a": {"os", "numpy", "torch"}, "pkg.b": {"typing", "triton"}}
    assert reachable(scan(pkg)[0], "pkg.a") == {"pkg.b"}


def test_the_scan_sees_the_package():
    # the walk reads the real tree: a known edge each way of writing an import
    graph, _ = scan(PACKAGE_ROOT)
    assert "trtllm_mtp_carry.serve.triton.client" in graph["trtllm_mtp_carry.bench.triton_driver"]
    assert "trtllm_mtp_carry.bench.main" in graph["trtllm_mtp_carry.cli"]


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    """pkg/a.py <-> pkg/b.py (b's edge inside a function, taking a's _hidden: same
    package, allowed), pkg/sub/c.py taking pkg.a._hidden (from-import),
    pkg.b._helper (attribute of a module alias) and pkg.b.Klass._secret
    (attribute of an imported class), pkg/e.py taking pkg.sub.c._inner
    (a parent package taking a child's), pkg/sub/d.py taking pkg.a._hidden
    (`import pkg.a`, then the dotted path) and c's _inner three ways (same
    package: allowed). Only a <-> b is a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n_hidden = 1\n")
    (pkg / "e.py").write_text("import os\n\ndef h():\n    from .sub.c import _inner\n    return _inner\n")
    (pkg / "b.py").write_text("def f():\n    from .a import _hidden\n    return _hidden\n"
                              "def _helper():\n    pass\nclass Klass:\n    _secret = 3\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import _hidden\nfrom .. import b as bee\n"
                                      "def g():\n    return bee._helper()\n_inner = 2\n"
                                      "from ..b import Klass\ny = Klass._secret\n")
    (pkg / "sub" / "d.py").write_text("from .c import _inner\nimport pkg.sub.c as cc\nx = cc._inner\n"
                                      "import pkg.a\nw = pkg.a._hidden\nv = pkg.sub.c._inner\n")
    return pkg


def test_the_check_flags_a_synthetic_cycle(synthetic: Path):
    graph, _ = scan(synthetic)
    assert graph["pkg.b"] == {"pkg.a"}  # the import inside a function counts
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_check_flags_synthetic_private_names_across_packages(synthetic: Path):
    assert sorted(str(u) for u in foreign_private_uses(synthetic)) == [
        "pkg.e:4 takes pkg.sub.c._inner",
        "pkg.sub.c:1 takes pkg.a._hidden",
        "pkg.sub.c:4 takes pkg.b._helper",
        "pkg.sub.c:7 takes pkg.b.Klass._secret",
        "pkg.sub.d:5 takes pkg.a._hidden",
    ]
