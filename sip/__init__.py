"""SIP: a SASS instruction-schedule engine for Hopper (sm_90 / sm_90a) cubins.

Layers, each in its own module:

* `sip.cubin`  - the ELF container: sections, symbols, relocations, `.nv.info` attributes, the
  instruction offsets other sections refer to (pinned), arch check, in-place `.text` patching.
* `sip.sass`   - nvdisasm-backed decoding: `Instruction` (128-bit word, control code, registers
  read/written), basic blocks.
* `sip.deps`   - the dependency model of a kernel: which adjacent instructions may swap, and the
  fixed-latency distances a reordering must keep.
* `sip.mutate` - immutable `Schedule` values, SIP's one-slot moves, control-code repair, `apply`.
* `sip.cli`    - the `sip` command (disasm / inspect / mutate).
"""


class SipError(Exception):
    """Any input SIP cannot work with; the message says what is wrong and what to do."""
