"""The tuned store (rosekernels.tuned), cubins and configs: keys, metadata, locking, and falling back to
the untuned kernel or the heuristic's config on any defect."""
import dataclasses
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


# ---------------------------------------------------------------------------------------------
# Tuned configs: <root>/<toolchain>/<kernel>/configs/<mode>-<bucket>-<original hash>.json

CONFIG_META = {"heuristic_median_us": 3.0, "tuned_median_us": 2.5, "speedup": 1.2, "aa_spread": 0.01,
               "gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00Z"}
SHA = "ab" * 32


def qk_configs(tokens=3000):
    """A prefill qk_norm shape, its heuristic config and another legal one (no compile)."""
    from rosekernels.kernels import qk_norm_plan as plan

    shape = plan.QKNormShape(tokens)
    heuristic = plan.config_for(shape, 132)
    other = next(c for c in plan.candidates(shape, 132) if c.variant() != heuristic.variant())
    return shape, heuristic, other


@pytest.fixture
def configs_fresh():
    tuned.forget_configs()
    yield
    tuned.forget_configs()


def test_config_entry_layout_and_round_trip(tmp_path, configs_fresh):
    shape, heuristic, other = qk_configs(3000)
    path = tuned.store_config(tmp_path, "qk_norm", shape, other, heuristic, SHA, CONFIG_META)
    toolchain = tuned.current_toolchain()
    assert path.parent == tmp_path / toolchain / "qk_norm" / "configs"
    assert path.name == f"prefill-{tuned.bucket_key(shape)}-{SHA[:16]}.json" and "tokens=4096" in path.name
    meta = json.loads(path.read_text())
    assert {k: meta[k] for k in CONFIG_META} == CONFIG_META
    assert meta["kernel"] == "qk_norm" and meta["mode"] == "prefill" and meta["arch"] == "sm_90a"
    assert meta["toolchain"] == toolchain and meta["original_sha256"] == SHA
    assert meta["shape"]["tokens"] == 3000 and meta["bucket"]["tokens"] == 4096
    assert meta["config_key"] == other.variant().key() and meta["heuristic_key"] == heuristic.variant().key()
    # Any shape of the bucket finds it, for that original only; the config comes back as a Config.
    entry = tuned.lookup_config(tmp_path, "qk_norm", dataclasses.replace(shape, tokens=2049), SHA)
    assert entry.path == path and entry.config == other and entry.heuristic == heuristic
    assert entry.speedup == 1.2 and entry.original_sha256 == SHA
    assert tuned.lookup_config(tmp_path, "qk_norm", dataclasses.replace(shape, tokens=2048), SHA) is None
    assert tuned.lookup_config(tmp_path, "qk_norm", dataclasses.replace(shape, tokens=4096, k_heads=4), SHA) is None
    assert tuned.lookup_config(tmp_path, "qk_norm", shape, "cd" * 32) is None
    assert [e.path for e in tuned.config_entries(tmp_path, "qk_norm")] == [path]
    assert tuned.config_entries(tmp_path, "rmsnorm") == []


def test_config_entries_are_read_once_per_root_and_kernel(tmp_path, configs_fresh):
    shape, heuristic, other = qk_configs()
    path = tuned.store_config(tmp_path, "qk_norm", shape, other, heuristic, SHA, CONFIG_META)
    assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA) is not None
    path.unlink()  # what this process read stays in memory ...
    assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA).config == other
    tuned.store_config(tmp_path, "qk_norm", shape, heuristic, heuristic, "cd" * 32, CONFIG_META)
    assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA) is None  # ... until a store re-reads


def test_the_better_config_entry_is_kept(tmp_path, configs_fresh):
    shape, heuristic, other = qk_configs()
    path = tuned.store_config(tmp_path, "qk_norm", shape, other, heuristic, SHA, CONFIG_META)
    assert tuned.store_config(tmp_path, "qk_norm", shape, heuristic, heuristic, SHA,
                              {**CONFIG_META, "speedup": 1.1}) == path
    assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA).config == other
    tuned.store_config(tmp_path, "qk_norm", shape, heuristic, heuristic, SHA, {**CONFIG_META, "speedup": 1.1},
                       keep_better=False)
    assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA).config == heuristic
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temp files


def _config_json(path):
    path.write_text("{not json")


def _config_moved(path):  # a whole entry, but under a name lookups of its bucket would not use
    path.rename(path.with_name(path.name.replace("tokens=4096", "tokens=8192")))


def _config_bad_field(path):
    meta = json.loads(path.read_text())
    meta["config"]["no_such_field"] = 1
    path.write_text(json.dumps(meta))


def _config_other_format(path):
    meta = json.loads(path.read_text())
    meta["format"] = 99
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt", [_config_json, _config_moved, _config_bad_field, _config_other_format])
def test_a_broken_config_entry_warns_and_is_ignored(tmp_path, configs_fresh, corrupt):
    shape, heuristic, other = qk_configs()
    path = tuned.store_config(tmp_path, "qk_norm", shape, other, heuristic, SHA, CONFIG_META)
    corrupt(path)
    tuned.forget_configs()
    with pytest.warns(UserWarning, match="ignoring tuned-config entry.*heuristic"):
        assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA) is None
    assert tuned.config_entries(tmp_path, "qk_norm") == []
    # The next store replaces a broken entry in place.
    if corrupt is not _config_moved:
        tuned.store_config(tmp_path, "qk_norm", shape, other, heuristic, SHA, CONFIG_META)
        assert tuned.lookup_config(tmp_path, "qk_norm", shape, SHA).config == other
