"""The tuned-cubin store (rosekernels.tuned): keys, metadata, locking, and falling back to the untuned
kernel on any defect."""
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from store_samples import META, ORIGINAL, TOOLCHAIN, TUNED, VARIANT, FakeVariant, make_cubin

from rosekernels import tuned


def put(root, cubin=TUNED, meta=META, **kw):
    return tuned.store(root, "qk_norm", VARIANT, ORIGINAL, cubin, meta, toolchain=TOOLCHAIN, **kw)


def get(root, original=ORIGINAL):
    return tuned.lookup(root, "qk_norm", VARIANT, original, toolchain=TOOLCHAIN)


def test_make_cubin_is_accepted_and_wrong_arch_or_size_is_not():
    tuned.check_sm90_cubin(ORIGINAL)
    with pytest.raises(tuned.CacheError, match="sm_80"):
        tuned.check_sm90_cubin(make_cubin(arch=80))
    with pytest.raises(tuned.CacheError):
        tuned.check_sm90_cubin(ORIGINAL[:-1])
    with pytest.raises(tuned.CacheError, match="ELF"):
        tuned.check_sm90_cubin(b"\0" * 200)


def test_entry_is_keyed_by_toolchain_kernel_variant_and_original_hash(tmp_path):
    path, written = put(tmp_path)
    assert written
    assert path == tmp_path / TOOLCHAIN / "qk_norm" / VARIANT.key() / tuned.sha256(ORIGINAL)
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == [
        "meta.json", "original.cubin", "tuned.cubin"]
    meta = json.loads((path / "meta.json").read_text())
    for field in ("baseline_median_us", "tuned_median_us", "speedup", "samples_passed", "search", "seed",
                  "gpu", "date"):
        assert meta[field] == META[field]
    assert meta["kernel"] == "qk_norm" and meta["mode"] == "decode" and meta["arch"] == "sm_90a"
    assert meta["spec_key"] == VARIANT.key() and meta["toolchain"] == TOOLCHAIN
    assert meta["original_sha256"] == tuned.sha256(ORIGINAL) and meta["tuned_sha256"] == tuned.sha256(TUNED)
    entry = get(tmp_path)
    assert entry.tuned == TUNED and entry.original == ORIGINAL and entry.speedup == pytest.approx(2.0 / 1.8)


def test_other_original_toolchain_or_variant_finds_nothing(tmp_path):
    put(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get(tmp_path, original=make_cubin(text=b"\x01" * 64)) is None
        assert tuned.lookup(tmp_path, "qk_norm", VARIANT, ORIGINAL, toolchain="other") is None
        assert tuned.lookup(tmp_path, "qk_norm", FakeVariant(d=64), ORIGINAL, toolchain=TOOLCHAIN) is None
    assert [e.tuned for e in tuned.entries_for_variant(tmp_path, VARIANT, toolchain=TOOLCHAIN)] == [TUNED]


def test_store_refuses_a_tuned_cubin_of_another_size_or_arch(tmp_path):
    with pytest.raises(ValueError, match="bytes"):
        put(tmp_path, cubin=make_cubin(text=b"\0" * 80))
    with pytest.raises(tuned.CacheError, match="sm_80"):
        put(tmp_path, cubin=make_cubin(arch=80, text=b"\x05" * 64))
    assert not any(tmp_path.rglob("tuned.cubin"))


def test_the_better_entry_is_kept(tmp_path):
    put(tmp_path)
    other = make_cubin(text=b"\x07" * 64)
    _, written = put(tmp_path, cubin=other, meta={**META, "speedup": 1.01})
    assert not written and get(tmp_path).tuned == TUNED
    _, written = put(tmp_path, cubin=other, meta={**META, "speedup": 1.5})
    assert written and get(tmp_path).tuned == other
    _, written = put(tmp_path, cubin=TUNED, meta={**META, "speedup": 1.0}, keep_better=False)
    assert written and get(tmp_path).tuned == TUNED


def _corrupt_truncated(path):
    (path / "tuned.cubin").write_bytes(TUNED[:100])


def _corrupt_json(path):
    (path / "meta.json").write_text("{not json")


def _corrupt_missing(path):
    (path / "tuned.cubin").unlink()


def _corrupt_original(path):  # the stored original no longer hashes to the entry's key
    (path / "original.cubin").write_bytes(make_cubin(text=b"\x09" * 64))


def _corrupt_tuned_swapped(path):  # same size, valid ELF, but not the cubin the metadata vouches for
    (path / "tuned.cubin").write_bytes(make_cubin(text=b"\x0a" * 64))


def _corrupt_arch(path):  # consistent hashes, but an sm_80 image
    bad = make_cubin(arch=80, text=bytes(reversed(range(64))))
    (path / "tuned.cubin").write_bytes(bad)
    meta = json.loads((path / "meta.json").read_text())
    meta["tuned_sha256"] = tuned.sha256(bad)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_json, _corrupt_missing, _corrupt_original,
                                     _corrupt_tuned_swapped, _corrupt_arch])
def test_a_broken_entry_warns_and_gives_the_untuned_kernel(tmp_path, corrupt):
    path, _ = put(tmp_path)
    corrupt(path)
    with pytest.warns(UserWarning, match="untuned"):
        assert get(tmp_path) is None
    with pytest.warns(UserWarning, match="untuned"):
        assert tuned.entries_for_variant(tmp_path, VARIANT, toolchain=TOOLCHAIN) == []
    rows = tuned.list_entries(tmp_path)
    assert len(rows) == 1 and not rows[0]["valid"] and rows[0]["kernel"] == "qk_norm"


def test_a_broken_entry_is_overwritten_by_the_next_store(tmp_path):
    path, _ = put(tmp_path)
    _corrupt_json(path)
    _, written = put(tmp_path, meta={**META, "speedup": 0.5})
    assert written and get(tmp_path).tuned == TUNED


def test_default_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "sipcache"))
    assert tuned.default_root() == tmp_path / "sipcache"
    assert tuned.resolve_root(None) == tmp_path / "sipcache"
    assert tuned.resolve_root(tmp_path) == tmp_path
    monkeypatch.delenv(tuned.ENV_VAR)
    monkeypatch.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path / "rk"))
    assert tuned.default_root() == tmp_path / "rk" / "sip"


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {support!r})
    from store_samples import FakeVariant, make_cubin, ORIGINAL, META, TOOLCHAIN
    from rosekernels import tuned
    me = int(sys.argv[1])
    for i in range(40):
        cubin = make_cubin(text=bytes([me * 50 + i % 50]) * 64)
        tuned.store({root!r}, "qk_norm", FakeVariant(d=128, dtype="bf16", warps=1), ORIGINAL, cubin,
                    {{**META, "speedup": 1.0 + i}}, keep_better=False, toolchain=TOOLCHAIN)
        if me == 2:  # the third process reads while the other two write
            e = tuned.lookup({root!r}, "qk_norm", FakeVariant(d=128, dtype="bf16", warps=1), ORIGINAL,
                             toolchain=TOOLCHAIN)
            assert e is not None
""")


def test_concurrent_writers_never_leave_a_broken_entry(tmp_path):
    script = WRITER.format(support=str(Path(__file__).parents[1] / "support"), root=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-W", "error", "-c", script, str(i)], stderr=subprocess.PIPE,
                              text=True) for i in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entry = get(tmp_path)
    assert entry is not None and entry.meta["speedup"] == 40.0
    assert not [p for p in entry.path.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temp files
