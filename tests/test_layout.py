"""The package's layout stays readable: a top level of at most 12 modules (the public API and the mechanism;
the rest in the folders of docs/design.md, *Layout*), imports without cycles in the package and in benchmarks/,
tests in folders that mirror the package's, a strategy that only wires, one definition of each checkpoint file
name and key, and comments that cite docs/design.md."""

import ast
import re
from pathlib import Path

import lightning_dpzero

PACKAGE = Path(lightning_dpzero.__file__).parent
ROOT = PACKAGE.name
REPO = PACKAGE.parent
TESTS = Path(__file__).resolve().parent
#: the most modules lightning_dpzero/*.py may hold (``__init__.py`` counted): what a user imports, and the mechanism
MAX_TOP_LEVEL = 12


def _modules(folder: Path) -> dict[str, tuple[Path, bool]]:
    out = {}
    for f in folder.rglob("*.py"):
        parts = list(f.relative_to(folder.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def import_graph(folder: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of ``folder`` (a package, or benchmarks/) it imports, at module level or inside
    functions alike (a lazy import hides a cycle, it does not remove it)."""
    modules = _modules(folder)
    graph: dict[str, set[str]] = {}
    for name, (f, is_pkg) in modules.items():
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                prefix = base[:len(base) - node.level + 1] if node.level else []
                module = ".".join(prefix + ([node.module] if node.module else []))
                for a in node.names:
                    targets.add(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module)
        graph[name] = {t for t in targets if t in modules and t != name and t.split(".")[0] == folder.name}
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        stack.pop()
        state[u] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_package_imports_are_acyclic():
    graph = import_graph()
    # the graph sees real edges: the strategy reaches the mechanism through the settings both strategies share,
    # and a folder's module the top level's (relative imports two levels up)
    assert "lightning_dpzero.lightning.settings" in graph["lightning_dpzero.lightning.strategy"]
    assert "lightning_dpzero.mechanism" in graph["lightning_dpzero.lightning.settings"]
    assert "lightning_dpzero.util.options" in graph["lightning_dpzero.per_sample.engine"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_benchmark_imports_are_acyclic():
    graph = import_graph(REPO / "benchmarks")
    assert "benchmarks.per_layer_rnn" in graph["benchmarks.per_layer"]  # the graph sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_a_cycle_would_be_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_top_level_holds_the_public_api_and_the_mechanism():
    top = sorted(f.name for f in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules at the top level (at most {MAX_TOP_LEVEL}): {top}"
    assert "__init__.py" in set(top) and (PACKAGE / "mechanism" / "__init__.py").is_file()


def test_design_layout_lists_the_tree():
    """docs/design.md's *Layout* names every folder of the package and every top-level module, and no module
    that is not there."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    block = layout[layout.index("```") + 3:]
    block = block[:block.index("```")]
    folders = sorted(d.name + "/" for d in PACKAGE.iterdir() if (d / "__init__.py").is_file())
    top = sorted(f.name for f in PACKAGE.glob("*.py"))
    named = set(re.findall(r"^ {2}([\w/]+(?:\.py|/))", block, re.M))
    assert named == set(folders) | set(top), sorted(named ^ (set(folders) | set(top)))
    for folder in folders:  # each file a folder's entry names exists there
        listed = re.search(rf"^ {{2}}{re.escape(folder)}(.*?)(?=^ {{2}}\S|\Z)", block, re.M | re.S).group(1)
        missing = [f for f in re.findall(r"^ {4}(\w+\.py)", listed, re.M) if not (PACKAGE / folder / f).is_file()]
        assert missing == [], (folder, missing)


def test_tests_mirror_the_package():
    """Every folder of tests/ holding tests is a folder of the package (or tests/reliability/, the crash and
    security suite); test file names are unique (the folders have no __init__.py: pytest imports by name)."""
    folders = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()} | {"reliability"}
    test_dirs = {f.parent for f in TESTS.rglob("test_*.py")} - {TESTS}
    assert {d.relative_to(TESTS).as_posix() for d in test_dirs} <= folders
    names = [f.name for f in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not list(TESTS.rglob("__init__.py"))


def test_the_strategy_only_wires():
    lines = (PACKAGE / "lightning" / "strategy.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, len(lines)


def _code_strings(f: Path) -> list[str]:
    """String constants of a file's code, docstrings, ``__all__`` and a lazy package's ``_EXPORTS`` (public
    names and their modules, not values) left out."""
    tree = ast.parse(f.read_text(encoding="utf-8"))
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("__all__", "_EXPORTS")
                                             for t in n.targets):
            skip |= {id(c) for c in ast.walk(n.value)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in skip]


def test_each_checkpoint_name_is_defined_once():
    from lightning_dpzero.checkpoints import format as names

    wanted = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
    wanted |= set(names.MODEL_STATES_FILES)
    found = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        for s in _code_strings(f):
            if s in wanted:
                found.setdefault(s, []).append(f.relative_to(PACKAGE).as_posix())
    assert set(found) == wanted
    assert {s: where for s, where in found.items() if where != ["checkpoints/format.py"]} == {}


def test_comments_cite_the_design_in_the_repository():
    stale = [f.relative_to(PACKAGE).as_posix() for f in sorted(PACKAGE.rglob("*.py"))
             if "DESIGN §" in f.read_text(encoding="utf-8")]
    assert stale == []


def test_overridden_lightning_methods_say_so():
    """Lightning's habit: every method that overrides a Lightning one carries ``@override``."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_dpzero import DPDeepSpeedStrategy, PrivacyAccountantCallback
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy

    from lightning_dpzero import DPFabricStrategy
    from lightning_dpzero.deepspeed.launch import DeepSpeedLaunchMixin, FabricDeepSpeedLaunchMixin
    from lightning_dpzero.metrics import PrivacyRunLogger

    missing = []
    for cls, base in ((DPDeepSpeedStrategy, DeepSpeedStrategy), (DeepSpeedLaunchMixin, DeepSpeedStrategy),
                      (DPFabricStrategy, FabricDeepSpeedStrategy),
                      (FabricDeepSpeedLaunchMixin, FabricDeepSpeedStrategy),
                      (PrivacyAccountantCallback, Callback), (PrivacyRunLogger, Callback)):
        for name, attr in vars(cls).items():
            if name.startswith("__") or not hasattr(base, name):
                continue
            func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if callable(func) and not getattr(func, "__override__", False):
                missing.append(f"{cls.__name__}.{name}")
    assert missing == []
