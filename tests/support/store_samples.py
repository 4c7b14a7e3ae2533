"""Sample entries for the tuned store: a minimal sm_90 cubin builder, a stand-in for jit.Variant
(no CuTeDSL import) and for a kernel module, and the metadata sip-tune writes."""
import struct
import types

TOOLCHAIN = "test-toolchain"


class FakeVariant:
    """What the store needs of a jit.Variant (keeps the store tests free of the CuTeDSL import)."""

    def __init__(self, op="qk_norm", mode="decode", **params):
        self.op, self.mode, self.arch = op, mode, "sm_90a"
        self.params = tuple(sorted(params.items()))

    def key(self):
        fields = "-".join(f"{k}={v}" for k, v in self.params)
        return f"{self.op}-{self.mode}-{self.arch}-{fields}"

    def as_dict(self):
        return {"op": self.op, "mode": self.mode, "arch": self.arch, "params": dict(self.params)}


def qk_norm_kernel():
    """What the config half of the store takes of a kernel module (OP, Config, Shape), from qk_norm's
    plan module (no CuTeDSL import)."""
    from rosekernels.kernels import qk_norm_plan as plan

    return types.SimpleNamespace(OP=plan.OP, Config=plan.QKNormConfig, Shape=plan.QKNormShape)


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


def checks(kind="cubin", samples=10_000, compare="bitwise", sanitizer="clean", speedup=2.0 / 1.8, aa=0.004):
    """meta["checks"] as sip-tune writes it, by default meeting the store's bar (kind "cubin" or
    "config": a config's record holds its bucket's edges too)."""
    out = {"samples": {"run": samples, "passed": samples}, "compare": compare,
           "tolerance": {"rtol": 1e-2, "atol": 0.0} if compare == "tolerance" else None,
           "sanitizer": dict.fromkeys(("memcheck", "racecheck", "synccheck"), sanitizer)
           if sanitizer != "not run" else "not run",
           "shapes": {"tuned": {"tokens": 1}, "tuned_samples": 8, "samples": "test sizes"},
           "op_level": {"speedup": speedup, "aa_spread": aa, "heuristic_us": 2.0, "tuned_us": 2.0 / speedup,
                        "peer": "none"}}
    if kind == "config":
        out["shapes"]["edges"] = [{"tokens": 3}, {"tokens": 4}]
    return out


ORIGINAL = make_cubin(text=bytes(range(64)))
TUNED = make_cubin(text=bytes(reversed(range(64))))
VARIANT = FakeVariant(d=128, dtype="bf16", warps=1)
META = {"baseline_median_us": 2.0, "tuned_median_us": 1.8, "speedup": 2.0 / 1.8, "samples_passed": 10000,
        "search": {"runs": 2, "budget_iters": 100}, "seed": 7, "gpu": "NVIDIA H200", "date": "2025-01-01T00:00:00",
        "checks": checks()}
CONFIG_META = {"heuristic_median_us": 3.0, "tuned_median_us": 2.5, "speedup": 1.2, "aa_spread": 0.01,
               "gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00Z", "checks": checks("config", speedup=1.2)}
