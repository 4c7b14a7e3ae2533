"""The layering of the tree, read from the import statements of every source file:

    bench/  ->  sip_tune/  ->  rosekernels/  ->  sip/ (the SASS engine)

no import runs back up, the engine needs neither torch nor CuTeDSL, plan modules import no device
code, kernel modules import no op (the ops in rosekernels/ops are built on the kernels, not the other way),
no module imports another's private names, and a benchmark script imports no other script (only the
shared timing, report and charts modules)."""
import ast
from pathlib import Path

import pytest

import rosekernels

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("sip", "rosekernels", "sip_tune", "bench")  # bottom up
BENCH_SHARED = {"timing", "report", "charts", "gemm_sweep"}


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
