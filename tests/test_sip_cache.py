"""The tuned-cubin cache: keys, metadata, locking, and falling back to the untuned kernel on any defect."""
import json
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from sip import cache

TOOLCHAIN = "test-toolchain"


class FakeVariant:
    """What the cache needs of a jit.Variant (keeps these tests free of the CuTeDSL import)."""

    def __init__(self, op="qk_norm", mode="decode", **params):
        self.op, self.mode, self.arch = op, mode, "sm_90a"
        self.params = tuple(sorted(params.items()))

    def key(self):
        fields = "-".join(f"{k}={v}" for k, v in self.params)
        return f"{self.op}-{self.mode}-{self.arch}-{fields}"

    def as_dict(self):
        return {"op": self.op, "mode": self.mode, "arch": self.arch, "params": dict(self.params)}


def make_cubin(arch=90, text=b"\x00" * 64) -> bytes:
    """A minimal executable ELF64 CUDA image: one kernel's code section and the section names."""
    names = b"\0.shstrtab\0.text.k\0"
    names += b"\0" * (-len(names) % 8)
    shoff = 64 + len(text) + len(names)
    header = bytearray(64)
    header[:8] = b"\x7fELF\x02\x01\x01\x33"
    struct.pack_into("<HHI", header, 0x10, 2, 190, 1)  # ET_EXEC, EM_CUDA, version
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<I", header, 0x30, (arch << 16) | arch)
    struct.pack_into("<HHHHHH", header, 0x34, 64, 0, 0, 64, 3, 1)
    sections = bytearray(3 * 64)  # null; .shstrtab; .text.k
    struct.pack_into("<IIQQQQ", sections, 64, 1, 3, 0, 0, 64 + len(text), len(names))
    struct.pack_into("<IIQQQQ", sections, 128, 11, 1, 6, 0, 64, len(text))
    return bytes(header) + text + names + bytes(sections)


ORIGINAL = make_cubin(text=bytes(range(64)))
TUNED = make_cubin(text=bytes(reversed(range(64))))
VARIANT = FakeVariant(d=128, dtype="bf16", warps=1)
META = {"baseline_median_us": 2.0, "tuned_median_us": 1.8, "speedup": 2.0 / 1.8, "samples_passed": 10000,
        "search": {"runs": 2, "budget_iters": 100}, "seed": 7, "gpu": "NVIDIA H200", "date": "2025-01-01T00:00:00"}


def put(root, tuned=TUNED, meta=META, **kw):
    return cache.store(root, "qk_norm", VARIANT, ORIGINAL, tuned, meta, toolchain=TOOLCHAIN, **kw)


def get(root, original=ORIGINAL):
    return cache.lookup(root, "qk_norm", VARIANT, original, toolchain=TOOLCHAIN)


def test_make_cubin_is_accepted_and_wrong_arch_or_size_is_not():
    cache.check_sm90_cubin(ORIGINAL)
    with pytest.raises(cache.CacheError, match="sm_80"):
        cache.check_sm90_cubin(make_cubin(arch=80))
    with pytest.raises(cache.CacheError):
        cache.check_sm90_cubin(ORIGINAL[:-1])
    with pytest.raises(cache.CacheError, match="ELF"):
        cache.check_sm90_cubin(b"\0" * 200)


def test_entry_is_keyed_by_toolchain_kernel_variant_and_original_hash(tmp_path):
    path, written = put(tmp_path)
    assert written
    assert path == tmp_path / TOOLCHAIN / "qk_norm" / VARIANT.key() / cache.sha256(ORIGINAL)
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == [
        "meta.json", "original.cubin", "tuned.cubin"]
    meta = json.loads((path / "meta.json").read_text())
    for field in ("baseline_median_us", "tuned_median_us", "speedup", "samples_passed", "search", "seed",
                  "gpu", "date"):
        assert meta[field] == META[field]
    assert meta["kernel"] == "qk_norm" and meta["mode"] == "decode" and meta["arch"] == "sm_90a"
    assert meta["spec_key"] == VARIANT.key() and meta["toolchain"] == TOOLCHAIN
    assert meta["original_sha256"] == cache.sha256(ORIGINAL) and meta["tuned_sha256"] == cache.sha256(TUNED)
    entry = get(tmp_path)
    assert entry.tuned == TUNED and entry.original == ORIGINAL and entry.speedup == pytest.approx(2.0 / 1.8)


def test_other_original_toolchain_or_variant_finds_nothing(tmp_path):
    put(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get(tmp_path, original=make_cubin(text=b"\x01" * 64)) is None
        assert cache.lookup(tmp_path, "qk_norm", VARIANT, ORIGINAL, toolchain="other") is None
        assert cache.lookup(tmp_path, "qk_norm", FakeVariant(d=64), ORIGINAL, toolchain=TOOLCHAIN) is None
    assert [e.tuned for e in cache.entries_for_variant(tmp_path, VARIANT, toolchain=TOOLCHAIN)] == [TUNED]


def test_store_refuses_a_tuned_cubin_of_another_size_or_arch(tmp_path):
    with pytest.raises(ValueError, match="bytes"):
        put(tmp_path, tuned=make_cubin(text=b"\0" * 80))
    with pytest.raises(cache.CacheError, match="sm_80"):
        put(tmp_path, tuned=make_cubin(arch=80, text=b"\x05" * 64))
    assert not any(tmp_path.rglob("tuned.cubin"))


def test_the_better_entry_is_kept(tmp_path):
    put(tmp_path)
    other = make_cubin(text=b"\x07" * 64)
    _, written = put(tmp_path, tuned=other, meta={**META, "speedup": 1.01})
    assert not written and get(tmp_path).tuned == TUNED
    _, written = put(tmp_path, tuned=other, meta={**META, "speedup": 1.5})
    assert written and get(tmp_path).tuned == other
    _, written = put(tmp_path, tuned=TUNED, meta={**META, "speedup": 1.0}, keep_better=False)
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
    meta["tuned_sha256"] = cache.sha256(bad)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_json, _corrupt_missing, _corrupt_original,
                                     _corrupt_tuned_swapped, _corrupt_arch])
def test_a_broken_entry_warns_and_gives_the_untuned_kernel(tmp_path, corrupt):
    path, _ = put(tmp_path)
    corrupt(path)
    with pytest.warns(UserWarning, match="untuned"):
        assert get(tmp_path) is None
    with pytest.warns(UserWarning, match="untuned"):
        assert cache.entries_for_variant(tmp_path, VARIANT, toolchain=TOOLCHAIN) == []
    rows = cache.list_entries(tmp_path)
    assert len(rows) == 1 and not rows[0]["valid"] and rows[0]["kernel"] == "qk_norm"


def test_a_broken_entry_is_overwritten_by_the_next_store(tmp_path):
    path, _ = put(tmp_path)
    _corrupt_json(path)
    _, written = put(tmp_path, meta={**META, "speedup": 0.5})
    assert written and get(tmp_path).tuned == TUNED


def test_default_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "sipcache"))
    assert cache.default_root() == tmp_path / "sipcache"
    assert cache.resolve_root(None) == tmp_path / "sipcache"
    assert cache.resolve_root(tmp_path) == tmp_path
    monkeypatch.delenv(cache.ENV_VAR)
    monkeypatch.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path / "rk"))
    assert cache.default_root() == tmp_path / "rk" / "sip"


WRITER = textwrap.dedent("""
    import sys, struct
    sys.path.insert(0, {tests!r})
    from test_sip_cache import FakeVariant, make_cubin, ORIGINAL, META, TOOLCHAIN
    from sip import cache
    me = int(sys.argv[1])
    for i in range(40):
        tuned = make_cubin(text=bytes([me * 50 + i % 50]) * 64)
        cache.store({root!r}, "qk_norm", FakeVariant(d=128, dtype="bf16", warps=1), ORIGINAL, tuned,
                    {{**META, "speedup": 1.0 + i}}, keep_better=False, toolchain=TOOLCHAIN)
        if me == 2:  # the third process reads while the other two write
            e = cache.lookup({root!r}, "qk_norm", FakeVariant(d=128, dtype="bf16", warps=1), ORIGINAL,
                             toolchain=TOOLCHAIN)
            assert e is not None
""")


def test_concurrent_writers_never_leave_a_broken_entry(tmp_path):
    script = WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
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
# rosekernels.warmup on top of the cache (CPU: compile and load, no launch).

def stalled(cubin: bytes) -> bytes:
    """The cubin with every instruction's stall count raised to 15: a same-size, valid 'tuned' cubin."""
    from sip.cubin import parse_cubin

    (code,) = parse_cubin(cubin).kernels()
    out = bytearray(cubin)
    for off in range(code.section.offset, code.section.offset + code.section.size, 16):
        word = int.from_bytes(out[off:off + 16], "little") | (0xF << 105)
        out[off:off + 16] = word.to_bytes(16, "little")
    return bytes(out)


@pytest.fixture
def jit_env(tmp_path, monkeypatch):
    from rosekernels import jit

    monkeypatch.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path / "rk"))
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "sip"))
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()
    yield jit
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()


def test_warmup_loads_the_tuned_cubin_and_reports_it(jit_env):
    import jit_demo_kernel as demo
    from rosekernels.startup import warmup

    jit = jit_env
    variant = jit.Variant.of("axpb_test", "decode", dtype="fp32")
    spec = lambda: jit.compile_variant(variant, demo.build)  # noqa: E731
    untuned = spec()  # loaded untuned before warmup: warmup must reload it
    tuned = stalled(untuned.cubin)
    cache.check_sm90_cubin(untuned.cubin)
    cache.store(None, "axpb", variant, untuned.cubin, tuned, META)
    report = warmup([spec])
    assert report.tuned == [variant.key()] and report.untuned == []
    (k,) = report.kernels
    assert k.tuned and k.cubin == untuned.cubin and jit.compile_variant(variant, demo.build) is k
    assert tuned in jit.swap_cubins(k.object_bytes)[0]
    assert "1 tuned, 0 untuned" in str(report)


def test_warmup_never_loads_a_tuned_cubin_for_another_original(jit_env):
    import jit_demo_kernel as demo
    from rosekernels.startup import warmup

    jit = jit_env
    variant = jit.Variant.of("axpb_test", "decode", dtype="fp32")
    k = jit.compile_variant(variant, demo.build)
    other = stalled(k.cubin)  # pretend the kernel changed since tuning: the entry's original is `other`
    cache.store(None, "axpb", variant, other, k.cubin, META)
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="another original"):
        report = warmup([lambda: jit.compile_variant(variant, demo.build)])
    assert report.untuned == [variant.key()] and report.stale == [variant.key()] and not report.kernels[0].tuned


def test_warmup_of_a_corrupt_entry_warns_and_loads_untuned(jit_env):
    import jit_demo_kernel as demo
    from rosekernels.startup import warmup

    jit = jit_env
    variant = jit.Variant.of("axpb_test", "decode", dtype="fp32")
    k = jit.compile_variant(variant, demo.build)
    path, _ = cache.store(None, "axpb", variant, k.cubin, stalled(k.cubin), META)
    (path / "tuned.cubin").write_bytes(stalled(k.cubin)[:500])
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="untuned"):
        report = warmup([lambda: jit.compile_variant(variant, demo.build)])
    assert report.untuned == [variant.key()] and not report.kernels[0].tuned


def test_warmup_accepts_variants_of_the_rosekernels_ops(jit_env):
    import torch
    from rosekernels.kernels import qk_norm
    from rosekernels.startup import warmup

    jit = jit_env
    variant = qk_norm.config_for(1, 32, 8, 128, torch.bfloat16, torch.bfloat16).variant()
    original = qk_norm.compile(variant).cubin
    cache.store(None, "qk_norm", variant, original, stalled(original), META)
    jit.forget_loaded()
    report = warmup([variant])
    assert report.tuned == [variant.key()] and report.kernels[0].variant == variant
    with pytest.raises(TypeError, match="warmup spec"):
        warmup([42])
