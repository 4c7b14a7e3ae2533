"""The layering of the tree, read from the import statements of every source file:

    bench/  ->  sip_tune/  ->  rosekernels/  ->  sip/ (the SASS engine)

no import runs back up, the engine needs neither torch nor CuTeDSL, plan modules import no device
code, kernel modules import no op (the ops in rosekernels/ops are built on the kernels, not the other way),
no module imports another's private names, a benchmark script imports no other script (only the
shared timing, report and charts modules), and no import cycle joins the package modules, counting
the arrows importlib.import_module and __import__ draw as well as the import statements."""
import ast
import graphlib
import importlib
import sys
from pathlib import Path

import pytest

import rosekernels

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("sip", "rosekernels", "sip_tune", "bench")  # bottom up
BENCH_SHARED = {"timing", "report", "charts", "gemm_sweep", "flashinfer_peer"}
PACKAGES = ("sip", "rosekernels", "sip_tune")  # what other code imports; bench/ and tools/ hold scripts
IMPORT_CALLS = {"importlib.import_module", "importlib.__import__", "__import__"}


def imports(path: Path) -> set[str]:
    """Dotted names of every module (and imported name) `path` imports, relative imports resolved
    against the file's package."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *([node.module] if node.module else [])))
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}
    return names


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("lower", range(len(LAYERS) - 1))
def test_no_import_runs_back_up(lower):
    above = LAYERS[lower + 1:]
    for path in sources(LAYERS[lower]):
        bad = sorted(n for n in imports(path) if n.split(".")[0] in above)
        assert not bad, f"{path.relative_to(ROOT)} imports a higher layer: {bad}"


def test_the_engine_imports_neither_torch_nor_cutedsl():
    for path in sources("sip"):
        bad = sorted(n for n in imports(path) if n.split(".")[0] in ("torch", "cutlass", "tvm_ffi", "filelock"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_plan_modules_import_no_device_code():
    plans = sorted((ROOT / "rosekernels" / "kernels").glob("*_plan.py"))
    assert {p.stem for p in plans} == {f"{k}_plan" for k in rosekernels.KERNELS}  # one per kernel module
    for path in plans:
        bad = sorted(n for n in imports(path) if n.split(".")[0] in ("cutlass", "tvm_ffi")
                     or n.startswith("rosekernels.jit") or (n.startswith("rosekernels.kernels.")
                                                            and not n.split(".")[2].endswith("_plan")))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_kernel_modules_import_no_op():
    for path in sorted((ROOT / "rosekernels" / "kernels").glob("*.py")):
        bad = sorted(n for n in imports(path) if n == "rosekernels.ops" or n.startswith("rosekernels.ops."))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("name", sorted(set(rosekernels.__all__) - {"warmup"}))
def test_every_public_op_lives_in_the_ops_layer(name):
    assert getattr(rosekernels, name).__module__.startswith("rosekernels.ops."), name


def test_no_module_imports_private_names_of_another():
    for layer in LAYERS:
        for path in sources(layer):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                    assert not private, f"{path.relative_to(ROOT)} imports {private} from {node.module}"


def test_a_benchmark_script_imports_no_other_script():
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    for path in (ROOT / "bench").glob("*.py"):
        bad = sorted(n for n in imports(path) if n in scripts - BENCH_SHARED - {path.stem})
        assert not bad, f"{path.relative_to(ROOT)} imports the script(s) {bad}"


# ---------------------------------------------------------------------------------------------
# Import cycles, dynamic imports included.

def module_files(root: Path, packages) -> dict[str, Path]:
    """Dotted name -> file of every module of `packages` under `root` (a package: its __init__.py)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path, packages) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports: by an import statement anywhere in the file, or
    by a call of importlib.import_module / __import__ whose target is a literal or an entry of a
    registry (a dict, list, tuple or string at module level, read from the module that holds it:
    `importlib.import_module(KERNELS[name])` imports every module KERNELS names). Only what a file
    names is an arrow (importing a.b runs a's __init__ first, which is no arrow from a.b to a).
    ValueError for a call whose target is neither: an arrow this graph cannot see."""
    modules = module_files(root, packages)
    return {name: {m for m in _imported(name, path, modules) if m in modules and m != name}
            for name, path in modules.items()}


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    bound = {}  # a name the file binds by importing -> the dotted name it stands for
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:package.count(".") + 2 - node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module)
                bound[a.asname or a.name] = f"{module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _dotted(node.func, bound) in IMPORT_CALLS:
            targets = _strings(node.args[0], bound, name)
            if targets is None:
                raise ValueError(f"{path}:{node.lineno}: {ast.unparse(node)} imports a module this test cannot "
                                 "name: give it a literal, or an entry of a registry at module level")
            found |= targets
    return found


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return bound.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bound)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _strings(node: ast.AST, bound: dict[str, str], here: str) -> set[str] | None:
    """Every string `node` can be (a literal, an entry of a registry, a sum of those); None: unknown."""
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _strings(node.left, bound, here), _strings(node.right, bound, here)
        return None if left is None or right is None else {a + b for a in left for b in right}
    value = _registry(node.value if isinstance(node, ast.Subscript) else node, bound, here)
    if isinstance(value, str):
        return None if isinstance(node, ast.Subscript) else {value}
    if isinstance(node, ast.Subscript) and isinstance(value, (dict, list, tuple, set, frozenset)):
        entries = set(value.values() if isinstance(value, dict) else value)
        return entries if all(isinstance(e, str) for e in entries) else None
    return None


def _registry(node: ast.AST, bound: dict[str, str], here: str):
    """The module-level value `node` names (a name of this module, or one read through an import), or None."""
    if isinstance(node, ast.Name) and node.id not in bound:
        owner, attr = here, node.id
    else:
        dotted = _dotted(node, bound)
        if dotted is None or "." not in dotted:
            return None
        owner, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(owner), attr)
    except (ImportError, AttributeError):  # a local variable, or not a module's name
        return None


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first again at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_no_import_cycle_counting_importlib():
    found = cycle(import_graph(ROOT, PACKAGES))
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_graph_follows_the_dynamic_imports_of_the_tree():
    """The lazy public names and the kernel registry are arrows of the graph (else the test above could
    pass by not seeing them)."""
    graph = import_graph(ROOT, PACKAGES)
    assert {"rosekernels.startup", "rosekernels.ops.moe", "rosekernels.ops.gemm"} <= graph["rosekernels"]
    assert set(rosekernels.KERNELS.values()) <= graph["rosekernels.kernels"]


LOADS = {  # how the synthetic package's module b imports module a while it runs
    "a literal": "importlib.import_module('{pkg}.a')",
    "a registry read through its package": "importlib.import_module({pkg}.REGISTRY['a'])",
    "a registry imported by name": "import_module(REGISTRY['a'] + '')",
    "__import__": "__import__('{pkg}.a')",
}


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """write(load): a package `pkg` under tmp_path in which a imports b and b's function runs `load`
    (importing a back, or not); the package's name."""
    pkg = f"cycle_probe_{abs(hash(str(tmp_path)))}"
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(load: str) -> str:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text(f"REGISTRY = {{'a': '{pkg}.a'}}\n")
        (tmp_path / pkg / "a.py").write_text(f"from {pkg} import b\n")
        (tmp_path / pkg / "b.py").write_text(
            f"import importlib\nfrom importlib import import_module\n\nimport {pkg}\nfrom {pkg} import REGISTRY\n\n\n"
            f"def load():\n    return {load.format(pkg=pkg)}\n")
        return pkg

    yield write
    for name in [m for m in sys.modules if m.split(".")[0] == pkg]:
        del sys.modules[name]


@pytest.mark.parametrize("how", sorted(LOADS))
def test_a_cycle_through_a_dynamic_import_is_found(synthetic, tmp_path, how):
    pkg = synthetic(LOADS[how])
    graph = import_graph(tmp_path, [pkg])
    assert graph[f"{pkg}.b"] == {pkg, f"{pkg}.a"}
    assert set(cycle(graph)) == {f"{pkg}.a", f"{pkg}.b"}


def test_the_same_package_without_the_dynamic_import_has_no_cycle(synthetic, tmp_path):
    pkg = synthetic("None")
    assert cycle(import_graph(tmp_path, [pkg])) is None


def test_a_dynamic_import_the_graph_cannot_name_is_an_error(synthetic, tmp_path):
    pkg = synthetic("importlib.import_module('.'.join(['{pkg}', 'a']))")
    with pytest.raises(ValueError, match=r"b\.py:9: .* imports a module this test cannot name"):
        import_graph(tmp_path, [pkg])
