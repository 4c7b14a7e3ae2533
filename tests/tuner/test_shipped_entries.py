"""The tuned cubins shipped with the package (rosekernels/tuned_entries, `tuned.SHIPPED_ROOT`): each must be a
whole entry that meets the store's bar, of this install's toolchain, tuned from the very cubin this source
compiles for its variant. A kernel edit or a CuTeDSL release that changes that cubin fails here, until the
entry is verified again on a GPU (`bench/sip_compute.py --store-floors`) or removed: otherwise users would
silently lose the gain it was shipped for."""
import pytest

import rosekernels.kernels
from rosekernels import jit, tuned
from rosekernels.variant import Variant

SHIPPED = sorted(p.parent for p in tuned.SHIPPED_ROOT.glob("*/*/*/*/meta.json"))


def test_entries_are_shipped():
    assert SHIPPED, f"no entry under {tuned.SHIPPED_ROOT}"


@pytest.mark.slow
@pytest.mark.parametrize("directory", SHIPPED, ids=lambda d: f"{d.parents[1].name}/{d.parent.name}")
def test_each_shipped_entry_meets_the_bar_and_is_tuned_from_what_this_source_compiles(directory):
    entry = tuned._read_entry(directory)  # whole: hashes, sizes, only the tuned kernel's code differs
    assert entry.problems == []
    meta = entry.meta
    assert meta["toolchain"] == jit.TOOLCHAIN == directory.parents[2].name, (
        f"shipped for {meta['toolchain']}, this install compiles with {jit.TOOLCHAIN}: verify the entry again")
    variant = Variant.from_dict(meta["variant"])
    assert variant.key() == directory.parent.name == meta["spec_key"]
    module = rosekernels.kernels.kernel_module(variant.op)
    compiled = module.compile(module.Config.from_variant(variant))
    assert tuned.sha256(compiled.cubin) == meta["original_sha256"], (
        f"{variant.key()} now compiles to another cubin: verify the entry again or remove it")
