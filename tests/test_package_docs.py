"""dir(rosekernels) lists every public op without loading CuTeDSL, and help(rosekernels) documents each op
with a one-line description and says what torch.ops.rosekernels.* are. Run in a fresh interpreter: the
rest of the suite has long imported CuTeDSL by the time this runs."""
import json
import re
import subprocess
import sys

import pytest

import rosekernels

PROBE = r"""
import json, pydoc, sys
import rosekernels
names = dir(rosekernels)
loaded_by_dir = sorted(m for m in sys.modules if m.split(".")[0] == "cutlass")
text = pydoc.render_doc(rosekernels, renderer=pydoc.plaintext)
print(json.dumps({"dir": names, "loaded_by_dir": loaded_by_dir, "help": text}))
"""


@pytest.fixture(scope="module")
def probe():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_dir_lists_every_op_without_loading_cutedsl(probe):
    assert set(rosekernels.__all__) <= set(probe["dir"])
    assert {"KERNELS", "__all__", "__doc__"} <= set(probe["dir"])  # and the module's own attributes
    assert probe["loaded_by_dir"] == []


def _description(text):
    return text.split("\nDESCRIPTION\n", 1)[1].split("\nPACKAGE CONTENTS\n", 1)[0]


def test_help_lists_each_op_once_with_a_description(probe):
    # The op table of the docstring: "    name(args)   description", a long signature's description on the next line.
    table = re.findall(r"^ {8}(\w+)\((.*)$", _description(probe["help"]), flags=re.M)
    ops = [name for name, _ in table]
    assert sorted(ops) == sorted(rosekernels.__all__) and len(ops) == len(set(ops))
    lines = _description(probe["help"]).splitlines()
    for name, rest in table:
        i = next(j for j, line in enumerate(lines) if line.startswith(f"        {name}("))
        described = rest.split(")", 1)[-1].strip() or lines[i + 1].strip()
        assert len(described.split()) >= 3, f"{name} has no description"


def test_help_says_what_the_custom_ops_are(probe):
    desc = " ".join(_description(probe["help"]).split())
    assert "torch.ops.rosekernels.* are the out-variant custom ops" in desc
    assert "torch.compile" in desc
