"""The engine stands alone: every sip module, and every engine test module, imports with torch,
CuTeDSL, TVM-FFI, filelock and rosekernels absent."""
import subprocess
import sys
from pathlib import Path

ABSENT = ("torch", "cutlass", "tvm_ffi", "filelock", "rosekernels")
TESTS = Path(__file__).parent
ENGINE = tuple(f"sip.{p.stem}" for p in sorted((TESTS.parents[1] / "sip").glob("*.py")))  # every module, new ones too

SCRIPT = """
import importlib, importlib.util, sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` raises ImportError
sys.path.insert(0, {support!r})
for name in {engine!r}:
    importlib.import_module(name)
for path in {tests!r}:  # the test modules too, as pytest loads them (by path)
    spec = importlib.util.spec_from_file_location("engine_test_" + path.rsplit("/", 1)[-1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("ok")
"""


def test_the_engine_imports_without_torch_cutedsl_and_rosekernels():
    tests = sorted(str(p) for p in TESTS.glob("test_*.py"))
    script = SCRIPT.format(absent=ABSENT, support=str(TESTS.parent / "support"), engine=ENGINE, tests=tests)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=TESTS.parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
