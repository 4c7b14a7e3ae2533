"""The tuned cubins shipped with the package (rosekernels/tuned_entries, `tuned.SHIPPED_ROOT`): each must be a
whole entry that meets the store's bar, of this install's toolchain, tuned from the very cubin this source
compiles for its variant. A kernel edit or a CuTeDSL release that changes that cubin fails here, until the
entry is verified again on a GPU (`bench/sip_compute.py --store-floors`) or removed: otherwise users would
silently lose the gain it was shipped for."""
import pytest

import rosekernels.kernels
from rosekernels import jit, launch, paths, tuned
from rosekernels.startup import warmup
from rosekernels.variant import Variant
from sip_tune import oplevel, tuning

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


@pytest.mark.slow
@pytest.mark.parametrize("directory", SHIPPED, ids=lambda d: f"{d.parents[1].name}/{d.parent.name}")
def test_a_search_from_the_stored_entry_starts_at_the_shipped_one(directory, tmp_path):
    """`sip-tune --start stored` with an empty store of the user's resumes from the shipped entry, found by the
    original this source compiles."""
    entry = tuned._read_entry(directory)
    variant = Variant.from_dict(entry.meta["variant"])
    module = rosekernels.kernels.kernel_module(variant.op)
    original = module.compile(module.Config.from_variant(variant)).cubin
    found = tuning.stored_start(tmp_path / "empty", entry.meta["kernel"], variant, original)
    assert found is not None and found.path == directory and found.tuned == entry.tuned


def _op_case(meta: dict) -> oplevel.Case:
    """The public op at the shape the entry was timed at through it."""
    shape = dict(meta["checks"]["op_level"]["shape"])
    if meta["kernel"] == "attention_varlen":
        return oplevel.CASES["attention_varlen"](oplevel.VarlenShape(**{**shape, "lengths": tuple(shape["lengths"])}))
    return oplevel.CASES[meta["kernel"]](rosekernels.kernels.kernel_module(meta["kernel"]).Shape(**shape))


@pytest.mark.gpu
@pytest.mark.parametrize("directory", SHIPPED, ids=lambda d: f"{d.parents[1].name}/{d.parent.name}")
def test_after_warmup_the_op_launches_the_shipped_cubin_and_gives_the_original_bits(directory, tmp_path, monkeypatch):
    """What a user gets: warmup loads the shipped entry with an empty store of their own, the public op at the
    shape it was timed at launches the tuned cubin, and writes the bits the original writes (the entries are
    stored as bitwise equal to it)."""
    import torch

    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "empty"))
    meta = tuned._read_entry(directory).meta
    assert meta["checks"]["compare"] == "bitwise"
    variant = Variant.from_dict(meta["variant"])
    module = rosekernels.kernels.kernel_module(variant.op)
    case = _op_case(meta)
    args = case.make_set(0, "cuda")
    outs = []

    def forget() -> None:  # nothing loaded, installed or planned: each arm starts as a fresh process would
        jit.forget_loaded()
        jit.uninstall_tuned_cubins()
        launch.forget_plans()

    try:
        for shipped in (False, True):
            forget()
            report = warmup([lambda: module.compile(module.Config.from_variant(variant))], shipped=shipped)
            assert [k.tuned for k in report.kernels] == [shipped]
            args[-1].fill_(float("nan"))
            case.call(args)
            torch.cuda.synchronize()
            assert [k.tuned for k in jit.loaded_variants() if k.variant == variant] == [shipped]
            outs.append(args[-1].clone())
    finally:
        forget()
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
