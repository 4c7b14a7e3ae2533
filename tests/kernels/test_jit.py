"""The compile framework: variant keys, the disk cache, cubin capture and tuned-cubin substitution."""
import hashlib
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rosekernels import jit
from sip import fatbin
from sip.cubin import parse_cubin

import jit_demo_kernel as demo

VARIANT = jit.Variant.of("axpb_test", "decode", dtype="fp32")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path))
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()
    yield tmp_path
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()


def test_variant_key_names_every_parameter():
    v = jit.Variant.of("qk_norm", "prefill", d=128, dtype="bf16", warps=8)
    assert v.key() == "qk_norm-prefill-sm_90a-d=128-dtype=bf16-warps=8"
    assert jit.Variant.of("qk_norm", "prefill", warps=8, dtype="bf16", d=128) == v
    with pytest.raises(ValueError, match="mode"):
        jit.Variant.of("qk_norm", "fast")


def test_compile_captures_an_sm90_cubin_and_writes_the_disk_cache(cache):
    k = jit.compile_variant(VARIANT, demo.build)
    assert k.cubin[:4] == b"\x7fELF" and not k.tuned
    assert k.cubin in k.object_bytes  # the exported object embeds it verbatim
    assert parse_cubin(k.cubin).arch == "sm_90a"  # the engine reads both ELF ABIs (cu12 and cu13 ptxas)
    phoff = int.from_bytes(k.cubin[0x20:0x28], "little")
    phentsize, phnum = (int.from_bytes(k.cubin[o:o + 2], "little") for o in (0x36, 0x38))
    assert phnum and phoff + phentsize * phnum <= len(k.cubin)  # the whole image, program headers too
    objs = list(cache.rglob("*.o"))
    assert len(objs) == 1 and objs[0].read_bytes() == k.object_bytes
    assert jit.compile_variant(VARIANT, demo.build) is k  # memory cache


def test_disk_cache_files_get_the_mode_open_would_give(cache):
    """Readable by every user (0o666 less the umask): a cache built ahead of time for others to load."""
    old = os.umask(0o022)
    try:
        jit.compile_variant(VARIANT, demo.build)
    finally:
        os.umask(old)
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".o", ".json"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files)


def test_variants_differing_after_a_dot_get_their_own_cache_files(cache):
    a = jit.Variant.of("axpb_test", "decode", eps=1e-06, weight="bf16")
    b = jit.Variant.of("axpb_test", "decode", eps=1e-06, weight="fp32")
    jit.compile_variant(a, demo.build)
    jit.compile_variant(b, demo.build)
    assert len(list(cache.rglob("*.o"))) == 2


def test_a_second_process_loads_from_disk_without_compiling(cache):
    k = jit.compile_variant(VARIANT, demo.build)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parents[1] / "support")!r})
        import cutlass.cute as cute
        from rosekernels import jit
        import jit_demo_kernel as demo
        def no_compile(*a, **k): raise SystemExit("compiled again")
        cute.compile = no_compile
        k = jit.compile_variant(jit.Variant.of("axpb_test", "decode", dtype="fp32"), demo.build)
        print(k.cubin_sha256)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**__import__("os").environ, "ROSEKERNELS_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == k.cubin_sha256


def test_corrupt_disk_entry_warns_and_recompiles(cache):
    k = jit.compile_variant(VARIANT, demo.build)
    obj = next(cache.rglob("*.o"))
    obj.write_bytes(obj.read_bytes()[:1000])
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="corrupt cache entry"):
        k2 = jit.compile_variant(VARIANT, demo.build)
    assert k2.cubin == k.cubin
    assert obj.read_bytes() == k.object_bytes  # rewritten whole


def test_tuned_cubin_is_swapped_in_on_load(cache):
    k = jit.compile_variant(VARIANT, demo.build)
    tuned = bytearray(k.cubin)
    tuned[-1] ^= 0xFF  # any same-size change stands in for a tuned schedule
    jit.install_tuned_cubin(k.cubin, bytes(tuned))
    patched, changed = jit.swap_cubins(k.object_bytes)
    assert changed and bytes(tuned) in patched and k.cubin not in patched
    assert len(patched) == len(k.object_bytes)
    jit.forget_loaded()
    assert jit.compile_variant(VARIANT, demo.build).tuned


def test_tuned_cubin_of_another_size_is_refused(cache):
    k = jit.compile_variant(VARIANT, demo.build)
    with pytest.raises(ValueError, match="bytes"):
        jit.install_tuned_cubin(k.cubin, k.cubin + b"\0")


def test_fatbin_entries_and_replacement(cache):
    k = jit.compile_variant(VARIANT, demo.build)
    start = k.object_bytes.find(fatbin.FATBIN_MAGIC.to_bytes(4, "little"))
    blob = k.object_bytes[start:]
    (entry,) = [e for e in fatbin.parse_fatbin(blob) if e.kind == fatbin.KIND_ELF]
    assert entry.arch == 90 and not entry.compressed
    other = bytes(len(k.cubin))
    swapped = fatbin.replace_cubin(blob, k.cubin, other)
    assert swapped[entry.offset:entry.offset + len(other)] == other
    with pytest.raises(fatbin.FatbinError):
        fatbin.replace_cubin(blob, k.cubin, other + b"\0")
    with pytest.raises(fatbin.FatbinError, match="magic"):
        fatbin.parse_fatbin(b"\x7fELF" + bytes(60))


@pytest.mark.gpu
def test_kernel_runs_from_memory_disk_and_tuned_paths(cache):
    import torch

    def check(k):
        x = torch.randn(1000, device="cuda")
        y = torch.full_like(x, float("nan"))
        k.fn(x, y)
        torch.testing.assert_close(y, x * 2 + 1)

    k = jit.compile_variant(VARIANT, demo.build)
    check(k)
    jit.forget_loaded()
    check(jit.compile_variant(VARIANT, demo.build))  # from disk
    # A tuned cubin differing only in stall counts must run and give the same result.
    tuned = bytearray(k.cubin)
    text = _text_section(k.cubin)
    for off in range(text[0], text[0] + text[1], 16):
        word = int.from_bytes(tuned[off:off + 16], "little")
        word |= 0xF << 105  # stall field: 15 cycles
        tuned[off:off + 16] = word.to_bytes(16, "little")
    jit.install_tuned_cubin(k.cubin, bytes(tuned))
    jit.forget_loaded()
    k3 = jit.compile_variant(VARIANT, demo.build)
    assert k3.tuned
    check(k3)


@pytest.mark.gpu
def test_kernel_uses_the_current_stream_and_captures_in_a_cuda_graph(cache):
    import torch

    k = jit.compile_variant(VARIANT, demo.build)
    x = torch.randn(4097, device="cuda")
    y = torch.full_like(x, float("nan"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            k.fn(x, y)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 2 + 1)


def _text_section(cubin: bytes) -> tuple[int, int]:
    """(offset, size) of the kernel's .text section, read straight from the ELF headers."""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    def sh(i):
        return struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
    strtab_off = sh(shstrndx)[4]
    for i in range(shnum):
        name_off, _, _, _, off, size = sh(i)
        name = cubin[strtab_off + name_off:cubin.index(b"\0", strtab_off + name_off)]
        if name.startswith(b".text."):
            return off, size
    raise AssertionError("no .text section")
