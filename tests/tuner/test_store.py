"""The tuned store (rosekernels.tuned), cubins and configs: keys, metadata, locking, and falling back to
the untuned kernel or the heuristic's config on any defect."""
import dataclasses
import json
import math
import os
import re
import stat
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
from store_samples import (CONFIG_META, META, ORIGINAL, TOOLCHAIN, TUNED, VARIANT, FakeVariant, checks, make_cubin,
                           qk_norm_kernel)

from rosekernels import paths, tuned


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


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_stored_files_get_the_mode_open_would_give(tmp_path, umask_022):
    """Readable by every user (0o666 less the umask), as a store shared between users or baked into
    an image needs; a temporary file's 0o600 would hide it from all but its writer."""
    path, _ = put(tmp_path)
    shape, heuristic, other = qk_configs()
    config, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META,
                                   toolchain=TOOLCHAIN)
    tuned.forget_configs()
    for file in (path / "meta.json", path / "tuned.cubin", path / "original.cubin", config):
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file


def test_other_original_toolchain_or_variant_finds_nothing(tmp_path):
    put(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get(tmp_path, original=make_cubin(text=b"\x01" * 64)) is None
        assert tuned.lookup(tmp_path, "qk_norm", VARIANT, ORIGINAL, toolchain="other") is None
        assert tuned.lookup(tmp_path, "qk_norm", FakeVariant(d=64), ORIGINAL, toolchain=TOOLCHAIN) is None
    assert [e.tuned for e in tuned.entries_for_variant(tmp_path, VARIANT, toolchain=TOOLCHAIN)] == [TUNED]


def test_store_refuses_a_tuned_cubin_of_another_size_or_arch(tmp_path):
    with pytest.raises(tuned.CacheError, match=f"tuned cubin has {len(ORIGINAL) + 16} bytes, the original {len(ORIGINAL)}"):
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


def test_a_search_that_beat_the_entry_it_started_from_replaces_it(tmp_path):
    """A resumed search (sip-tune --start stored) beat its start in the same re-times: its entry replaces the
    start's although the speedup the start recorded in another run is higher; not past the A/A spread, or
    from another start, or less checked, it does not."""
    put(tmp_path)
    other = make_cubin(text=b"\x07" * 64)
    start = {"sha256": tuned.sha256(TUNED), "speedup": 1.05, "over_start": 1.004}
    lower = {**META, "speedup": 1.02, "aa_spread": 0.001}
    for meta in ({**lower, "start": {**start, "over_start": 1.0005}},  # inside the A/A spread
                 {**lower, "start": {**start, "sha256": tuned.sha256(ORIGINAL)}},  # another start
                 {**lower, "start": start, "checks": {**META["checks"], "sanitizer": "not run"}}):  # less checked
        _, written = put(tmp_path, cubin=other, meta=meta)
        assert not written and get(tmp_path).tuned == TUNED
    _, written = put(tmp_path, cubin=other, meta={**lower, "start": start})
    assert written and get(tmp_path).tuned == other


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


def test_paths_decide_both_roots(tmp_path, monkeypatch):
    """The tuned store: a folder named, else the process's choice, else $SIP_CACHE_DIR, else sip/ in the
    compile cache, whose root is the process's choice, else $ROSEKERNELS_CACHE_DIR, else the user's."""
    monkeypatch.setattr(paths, "_compile_cache", None)  # restored afterwards, whatever the test sets
    monkeypatch.setattr(paths, "_tuned_store", None)
    monkeypatch.delenv(paths.COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "sipcache"))
    assert paths.compile_cache_root() == tmp_path / "xdg" / "rosekernels"
    assert paths.tuned_store_root() == tmp_path / "sipcache"
    assert paths.tuned_store_root(tmp_path / "named") == tmp_path / "named"
    monkeypatch.delenv(paths.TUNED_STORE_ENV)
    monkeypatch.setenv(paths.COMPILE_CACHE_ENV, str(tmp_path / "rk"))
    assert paths.compile_cache_root() == tmp_path / "rk" and paths.tuned_store_root() == tmp_path / "rk" / "sip"
    paths.use_compile_cache_root(tmp_path / "prebuilt")
    assert paths.compile_cache_root() == tmp_path / "prebuilt"
    assert paths.tuned_store_root() == tmp_path / "prebuilt" / "sip"
    paths.use_tuned_store_root(str(tmp_path / "chosen"))
    assert paths.tuned_store_root() == tmp_path / "chosen" and paths.tuned_store_root("x") == Path("x")
    paths.use_compile_cache_root(None)
    paths.use_tuned_store_root(None)
    assert paths.compile_cache_root() == tmp_path / "rk" and paths.tuned_store_root() == tmp_path / "rk" / "sip"
    # the store's functions take the same root
    put(None)
    assert get(tmp_path / "rk" / "sip") is not None


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
# Tuned configs: <root>/<toolchain>/<kernel>/configs/<mode>-<bucket>-<heuristic hash>-<original hash>.json

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
    path, written = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
    toolchain = tuned.current_toolchain()
    assert path.parent == tmp_path / toolchain / "qk_norm" / "configs"
    assert written and path.name.startswith(f"prefill-{tuned.bucket_key(shape)}-") and "tokens=4096" in path.name
    assert path.name.endswith(f"-{SHA[:16]}.json")
    meta = json.loads(path.read_text())
    assert {k: meta[k] for k in CONFIG_META} == CONFIG_META
    assert meta["kernel"] == "qk_norm" and meta["mode"] == "prefill" and meta["arch"] == "sm_90a"
    assert meta["toolchain"] == toolchain and meta["original_sha256"] == SHA
    assert meta["shape"]["tokens"] == 3000 and meta["bucket"]["tokens"] == 4096
    assert meta["config_key"] == other.variant().key() and meta["heuristic_key"] == heuristic.variant().key()
    # Any shape of the bucket finds it, for that original only; the config comes back as a Config.
    entry = tuned.lookup_config(tmp_path, qk_norm_kernel(), dataclasses.replace(shape, tokens=2049), heuristic, SHA)
    assert entry.path == path and entry.config == other and entry.heuristic == heuristic
    assert entry.speedup == 1.2 and entry.original_sha256 == SHA
    below = dataclasses.replace(shape, tokens=2048)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), below, heuristic, SHA) is None
    other_heads = dataclasses.replace(shape, tokens=4096, k_heads=4)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), other_heads, heuristic, SHA) is None
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, "cd" * 32) is None
    assert [e.path for e in tuned.config_entries(tmp_path, qk_norm_kernel())] == [path]
    assert tuned.config_entries(tmp_path, types.SimpleNamespace(OP="rmsnorm")) == []


def test_config_entries_are_read_once_per_root_and_kernel(tmp_path, configs_fresh):
    shape, heuristic, other = qk_configs()
    path, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA) is not None
    path.unlink()  # what this process read stays in memory ...
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == other
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, heuristic, heuristic, "cd" * 32, CONFIG_META)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA) is None  # ... until a store re-reads


def test_the_better_config_entry_is_kept(tmp_path, configs_fresh):
    shape, heuristic, other = qk_configs()
    path, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
    assert tuned.store_config(tmp_path, qk_norm_kernel(), shape, heuristic, heuristic, SHA,
                              {**CONFIG_META, "speedup": 1.1}) == (path, False)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == other
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, heuristic, heuristic, SHA, {**CONFIG_META, "speedup": 1.1},
                       keep_better=False)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == heuristic
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temp files


def test_heuristics_differing_only_in_launch_settings_keep_their_own_entries(tmp_path, configs_fresh):
    """attention_decode's heuristic at this shape takes 1 split on 132 SMs and 8 on 114: one cubin (a
    split count is a launch setting), so one original hash, yet two entries, each found by its own
    heuristic; neither replaces the other."""
    from rosekernels.kernels import attention_decode_plan as plan

    module = types.SimpleNamespace(OP=plan.OP, Config=plan.DecodeConfig, Shape=plan.DecodeShape)
    shape = plan.DecodeShape(batch=16, seqlen_kv=4096)
    sxm, pcie = plan.config_for(shape, 132), plan.config_for(shape, 114)
    assert sxm.variant() == pcie.variant() and sxm.splits != pcie.splits
    stored = [tuned.store_config(tmp_path, module, shape, dataclasses.replace(h, num_stages=stages), h, SHA,
                                 CONFIG_META) for h, stages in ((sxm, 4), (pcie, 5))]
    assert all(written for _, written in stored) and stored[0][0] != stored[1][0]
    assert tuned.lookup_config(tmp_path, module, shape, sxm, SHA).config.num_stages == 4
    assert tuned.lookup_config(tmp_path, module, shape, pcie, SHA).config.num_stages == 5


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
    path, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
    corrupt(path)
    tuned.forget_configs()
    with pytest.warns(UserWarning, match="ignoring tuned-config entry.*heuristic"):
        assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA) is None
    assert tuned.config_entries(tmp_path, qk_norm_kernel()) == []
    # The next store replaces a broken entry in place.
    if corrupt is not _config_moved:
        tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
        assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == other


# ---------------------------------------------------------------------------------------------
# How an entry was checked: the bar, the opt-in, and which entry replaces which.

@pytest.mark.parametrize("kind, meta, expected", [
    ("cubin", {"checks": checks()}, []),
    ("config", {"checks": checks("config")}, []),
    ("cubin", {}, ["unverified: written before entries recorded how they were checked"]),
    ("cubin", {"checks": checks(samples=9999)}, ["9999 of 9999 samples passed"]),
    ("cubin", {"checks": {**checks(), "samples": {"run": 20000, "passed": 12000}}}, ["12000 of 20000"]),
    ("cubin", {"checks": checks(compare="tolerance")}, ["compared at rtol=0.01, atol=0.0, not bitwise"]),
    ("config", {"checks": checks("config", compare="reference")}, []),
    ("cubin", {"checks": checks(sanitizer="not run")}, ["compute-sanitizer not run"]),
    ("config", {"checks": checks("config", sanitizer="not run")}, ["compute-sanitizer not run"]),
    ("config", {"checks": checks("config", sanitizer="exit 99: hazard")}, ["compute-sanitizer: memcheck exit 99"]),
    ("cubin", {"checks": {**checks(), "sanitizer": {"memcheck": "clean", "racecheck": "exit 99: hazard",
                                                    "synccheck": "clean"}}}, ["compute-sanitizer: racecheck exit 99"]),
    ("cubin", {"checks": checks(speedup=1.003, aa=0.004)}, ["op-level 1.0030x the original, not past 1 + its A/A"]),
    ("config", {"checks": checks("config", speedup=0.99)}, ["op-level 0.9900x the heuristic"]),
    ("cubin", {"checks": {**checks(), "op_level": "not run"}}, ["no op-level re-time"]),
    ("cubin", {"checks": {**checks(), "op_level": "the op is not timed here"}},
     ["no op-level re-time (the op is not timed here)"]),
    ("cubin", {"checks": {**checks(), "shapes": {"tuned": {"tokens": 1}, "tuned_samples": 0}}},
     ["not compared at the tuned shape"]),
    ("config", {"checks": checks()}, ["not tested at its bucket's edges"]),
    ("config", {"config": {"a": 1}, "heuristic": {"a": 1}}, []),  # the heuristic kept: nothing to check
    ("config", {"config": {"a": 2}, "heuristic": {"a": 1}}, ["unverified"]),
    ("cubin", {"checks": checks(samples=5, sanitizer="not run", speedup=1.0)},
     ["5 of 5", "compute-sanitizer not run", "op-level 1.0000x"]),
    # hand-edited records of the wrong type: below the bar with the reason, never an exception
    ("cubin", {"checks": {**checks(), "samples": {"run": 10_000, "passed": None}}}, ["malformed samples record"]),
    ("config", {"checks": {**checks("config"), "samples": "all of them"}}, ["malformed samples record"]),
    ("cubin", {"checks": {**checks(), "samples": {"run": 1e4, "passed": True}}}, ["malformed samples record"]),
    ("config", {"checks": {**checks("config"), "op_level": {"speedup": 1.2, "aa_spread": None}}},
     ["malformed op-level record: A/A spread None"]),
    ("cubin", {"checks": {**checks(), "op_level": {"speedup": "1.2", "aa_spread": 0.0}}}, ["no op-level re-time"]),
    ("cubin", {"checks": {**checks(), "op_level": {"speedup": 10**400, "aa_spread": 0.0}}}, ["no op-level re-time"]),
    ("config", {"checks": {**checks("config"), "op_level": {"speedup": math.inf, "aa_spread": 0.0}}},
     ["no op-level re-time"]),
    ("cubin", {"checks": {**checks(), "op_level": {"speedup": 1.2, "aa_spread": 10**400}}},
     ["malformed op-level record: A/A spread 1000"]),
    ("cubin", {"checks": {**checks(), "op_level": {"speedup": 1.2, "aa_spread": math.nan}}},
     ["malformed op-level record: A/A spread nan"]),
    ("config", {"checks": {**checks("config"), "shapes": {"tuned_samples": "8", "edges": []}}},
     ["not compared at the tuned shape"]),
])
def test_the_bar_names_every_check_an_entry_lacks(kind, meta, expected):
    problems = tuned.bar_problems(meta, kind)
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected)), problems
    assert tuned.strength(meta, kind)[0] == (not expected)


@pytest.fixture
def no_opt_in(monkeypatch):
    """Entries below the bar not allowed; nothing warned about yet."""
    monkeypatch.delenv(tuned.ALLOW_ENV, raising=False)
    monkeypatch.setattr(tuned, "_reported", set())
    tuned.allow_unverified(None)
    yield
    tuned.allow_unverified(None)


@pytest.mark.parametrize("number", ["1" + "0" * 400, "Infinity", "NaN", "1" * 5000],
                         ids=["10**400", "Infinity", "NaN", "5000 digits"])
def test_a_hand_edited_number_out_of_range_never_raises(tmp_path, configs_fresh, no_opt_in, monkeypatch, number):
    """A speedup past the float range, or not finite, is no number: the entry is below the bar and
    ranks as no speedup. One past int()'s digit limit leaves the JSON unreadable: a broken entry."""
    monkeypatch.setattr(tuned, "current_toolchain", lambda: TOOLCHAIN)
    path, _ = put(tmp_path)
    shape, heuristic, other = qk_configs()
    config, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
    for file in (path / "meta.json", config):
        file.write_text(re.sub(r'"speedup": [0-9.]+', f'"speedup": {number}', file.read_text()))
    tuned.forget_configs()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        cubins = tuned.entries_for_variant(tmp_path, VARIANT, TOOLCHAIN)
        assert get(tmp_path) == (cubins[0] if cubins else None)
        configs = tuned.config_entries(tmp_path, qk_norm_kernel())
        rows = tuned.list_entries(tmp_path)
        admitted = [tuned.admitted(e) for e in cubins + configs]
    if len(number) > 4300:
        assert cubins == configs == [] and [r["valid"] for r in rows] == [False, False]
        assert all("ignoring tuned" in str(w.message) for w in warned) and warned
    else:
        assert len(cubins) == len(configs) == 1 and admitted == [False, False]
        assert [e.speedup for e in cubins + configs] == [0.0, 0.0]
        assert all(r["valid"] and r["problems"] == ["no op-level re-time"] for r in rows)


def test_an_entry_below_the_bar_is_refused_and_reported_unless_the_user_opts_in(tmp_path, no_opt_in, monkeypatch):
    assert tuned.ALLOW_ENV == "SIP_ALLOW_UNVERIFIED"
    put(tmp_path, meta={**META, "checks": checks(sanitizer="not run")})
    entry = get(tmp_path)  # read back whole: whether to load it is admitted's call
    assert entry is not None and entry.problems == ["compute-sanitizer not run"]
    with pytest.warns(UserWarning, match="below the default bar.*not loaded.*SIP_ALLOW_UNVERIFIED=1"):
        assert not tuned.admitted(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert not tuned.admitted(entry)
    monkeypatch.setenv(tuned.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="loading it anyway"):  # never silently
        assert tuned.admitted(entry)
    tuned.allow_unverified(False)  # warmup's argument wins over the environment
    assert not tuned.admitted(entry)
    path, _ = put(tmp_path / "good")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.admitted(get(tmp_path / "good"))


def test_old_entries_without_checks_are_unverified(tmp_path, no_opt_in):
    old = {k: v for k, v in META.items() if k != "checks"}
    put(tmp_path, meta=old)
    entry = get(tmp_path)
    assert entry.problems and "re-run sip-tune" in entry.problems[0]
    with pytest.warns(UserWarning, match="written before entries recorded how they were checked"):
        assert not tuned.admitted(entry)


def test_a_weaker_cubin_entry_never_replaces_a_stronger_one(tmp_path):
    other = make_cubin(text=b"\x07" * 64)
    put(tmp_path)  # meets the bar, 1.11x
    for weaker in (checks(sanitizer="not run", speedup=1.5), checks(samples=1000, speedup=1.5),
                   checks(compare="tolerance", speedup=1.5), checks(speedup=1.002, aa=0.004)):
        _, written = put(tmp_path, cubin=other, meta={**META, "speedup": 1.5, "checks": weaker})
        assert not written and get(tmp_path).tuned == TUNED
    _, written = put(tmp_path, cubin=other, meta={**META, "speedup": 1.05, "checks": checks(speedup=1.05)})
    assert not written  # as strong, slower
    _, written = put(tmp_path, cubin=other, meta={**META, "speedup": 1.2, "checks": checks(speedup=1.2)})
    assert written and get(tmp_path).tuned == other  # as strong, faster
    # a stronger entry replaces a weaker one whatever the speedups
    _, written = put(tmp_path / "b", meta={**META, "speedup": 1.5, "checks": checks(sanitizer="not run")})
    _, written = put(tmp_path / "b", cubin=other, meta={**META, "speedup": 1.02, "checks": checks(speedup=1.02)})
    assert written and get(tmp_path / "b").tuned == other
    # among two below the bar, the one meeting more of it stays
    put(tmp_path / "c", meta={**META, "checks": checks(sanitizer="not run", speedup=1.02, aa=0.05)})
    _, written = put(tmp_path / "c", cubin=other, meta={**META, "speedup": 1.9,
                                                        "checks": checks(samples=10, sanitizer="not run")})
    assert not written


def test_a_weaker_config_entry_never_replaces_a_stronger_one(tmp_path):
    shape, heuristic, other = qk_configs()
    tuned.forget_configs()
    path, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, CONFIG_META)
    weak = {**CONFIG_META, "speedup": 1.6, "checks": checks("config", samples=100, speedup=1.6)}
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, heuristic, heuristic, SHA, {**CONFIG_META, "speedup": 1.0})
    # the heuristic record is slower
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == other
    third = next(c for c in qk_norm_plan().candidates(shape, 132) if c not in (heuristic, other))
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, third, heuristic, SHA, weak)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == other
    # an entry that keeps the heuristic is as strong as any that meets the bar: a verified winner
    # replaces it, an unverified one does not
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, heuristic, heuristic, SHA, {"speedup": 1.0},
                       keep_better=False)
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, third, heuristic, SHA, weak)
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == heuristic
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, third, heuristic, SHA, {**CONFIG_META, "speedup": 1.03})
    assert tuned.lookup_config(tmp_path, qk_norm_kernel(), shape, heuristic, SHA).config == third
    assert path.exists() and len(list(path.parent.glob("*.json"))) == 1
    tuned.forget_configs()


def qk_norm_plan():
    from rosekernels.kernels import qk_norm_plan as plan

    return plan


def test_list_entries_says_which_meet_the_bar_for_both_kinds(tmp_path):
    put(tmp_path)
    put(tmp_path / "x", meta={**META, "checks": checks(samples=50)})
    shape, heuristic, other = qk_configs()
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, SHA, {"speedup": 1.3}, toolchain=TOOLCHAIN)
    bad, _ = tuned.store_config(tmp_path, qk_norm_kernel(), dataclasses.replace(shape, tokens=9000), other, heuristic,
                                SHA, CONFIG_META, toolchain=TOOLCHAIN)
    bad.write_text("{")
    tuned.forget_configs()
    rows = tuned.list_entries(tmp_path)
    kinds = sorted((r["kind"], r["valid"], tuple(r.get("problems", ("broken",)))) for r in rows)
    assert kinds[0][:2] == ("config", False) and kinds[1][:2] == ("config", True) and "unverified" in kinds[1][2][0]
    assert kinds[2] == ("cubin", True, ())
    assert len(rows) == 3  # the entry under tmp_path / "x" is another root
    assert tuned.list_entries(tmp_path / "x")[0]["problems"] == [
        f"50 of 50 samples passed (the bar: all of at least {tuned.BAR_SAMPLES})"]


# ---------------------------------------------------------------------------------------------
# A tuned cubin may differ from its original only in the tuned kernel's code (real cubins).

@pytest.fixture(scope="module")
def demo_cubins():
    """(original, tuned): the jit demo kernel compiled for sm_90a (CPU) and three legal moves of the
    engine applied to it, as the tuner makes them."""
    import jit_demo_kernel as demo

    from rosekernels import jit
    from sip import mutate
    from sip_tune import tuning

    original = jit.compile_variant(jit.Variant.of("axpb_test", "decode", dtype="fp32"), demo.build).cubin
    schedule, moves = mutate.random_walk(tuning.engine_initial(original, "all"), 3, seed=1)
    tuned_cubin = mutate.apply(schedule)
    assert moves and tuned_cubin != original and len(tuned_cubin) == len(original)
    return original, tuned_cubin


def _section(data, prefix):
    from sip import cubin

    return next(s for s in cubin.parse_cubin(data).sections if s.name.startswith(prefix))


def _tamper_nv_info(data):
    sec = _section(data, ".nv.info.")
    return sec.offset + sec.size - 1, "section .nv.info."  # the last attribute's payload


def _tamper_symtab(data):
    return _section(data, ".symtab").offset + 24 + 16, "section .symtab"  # a symbol's size


def _tamper_constants(data):
    sec = _section(data, ".nv.constant0.")
    return sec.offset + sec.size - 1, "section .nv.constant0."


def _tamper_elf_header(data):
    return 0x18, "the ELF header"  # e_entry


def _tamper_section_header(data):
    import struct

    shoff, = struct.unpack_from("<Q", data, 0x28)
    return shoff + 64 * _section(data, ".nv.info.").index + 16, "the section headers"  # sh_addr


@pytest.mark.parametrize("tamper", [_tamper_nv_info, _tamper_symtab, _tamper_constants, _tamper_elf_header,
                                    _tamper_section_header])
def test_a_tuned_cubin_changed_outside_its_kernels_code_is_refused(tmp_path, demo_cubins, tamper):
    from sip import cubin

    original, good = demo_cubins
    kernel = cubin.parse_cubin(original).main_kernel().name
    assert tuned.check_only_code_differs(original, good) == kernel
    at, where = tamper(good)
    bad = bytearray(good)
    bad[at] ^= 0x01
    bad = bytes(bad)
    tuned.check_sm90_cubin(bad)  # still a whole sm_90 cubin: only the diff gives it away
    with pytest.raises(tuned.CacheError, match=f"outside {kernel}'s code, at byte {at} \\({where}"):
        tuned.check_only_code_differs(original, bad)
    with pytest.raises(tuned.CacheError, match="outside"):
        tuned.store(tmp_path, "axpb", VARIANT, original, bad, META, toolchain=TOOLCHAIN)
    assert not any(tmp_path.rglob("tuned.cubin"))
    # Written past the store (by hand, or by an older sip-tune): refused when read, with the reason.
    path, written = tuned.store(tmp_path, "axpb", VARIANT, original, good, META, toolchain=TOOLCHAIN)
    assert written
    (path / "tuned.cubin").write_bytes(bad)
    meta = json.loads((path / "meta.json").read_text())
    meta["tuned_sha256"] = tuned.sha256(bad)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=f"outside {kernel}'s code.*untuned"):
        assert tuned.lookup(tmp_path, "axpb", VARIANT, original, toolchain=TOOLCHAIN) is None
    [row] = tuned.list_entries(tmp_path)
    assert not row["valid"] and where in row["error"]
