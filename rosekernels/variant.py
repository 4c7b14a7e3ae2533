"""What identifies one compiled kernel, without CuTeDSL: plan modules and the tuned store name
kernels by it, and import nothing that compiles."""
from __future__ import annotations

import dataclasses
from typing import Any

ARCH = "sm_90a"
MODES = ("prefill", "decode")


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is one of MODES."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """What identifies one compiled kernel: op, prefill|decode, and every compile-time parameter."""

    op: str
    mode: str  # "prefill" or "decode"
    params: tuple[tuple[str, Any], ...]  # sorted (name, value); values are str/int/float/bool
    arch: str = ARCH

    @classmethod
    def of(cls, op: str, mode: str, **params: Any) -> "Variant":
        check_mode(mode)
        return cls(op, mode, tuple(sorted(params.items())))

    def key(self) -> str:
        """Readable, file-name-safe and unique: `op-mode-arch-k=v-...`."""
        fields = "-".join(f"{k}={v}" for k, v in self.params)
        return f"{self.op}-{self.mode}-{self.arch}-{fields}".replace("/", "_").replace(" ", "")

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "mode": self.mode, "arch": self.arch, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Variant":
        """The variant `as_dict` wrote (a cache entry's or a tuned entry's metadata, a suite state)."""
        return cls(d["op"], d["mode"], tuple(sorted(d["params"].items())), d["arch"])
