"""SIP: a SASS instruction-schedule engine for Hopper (sm_90 / sm_90a) cubins.

Layers, each in its own module:

* `sip.fatbin` - find and replace cubins inside a CUDA fatbin container.
* `sip.cubin`  - the ELF container: sections, symbols, relocations, `.nv.info` attributes, the
  instruction offsets other sections refer to (pinned), arch check, in-place `.text` patching.
* `sip.sass`   - nvdisasm-backed decoding: `Instruction` (128-bit word, control code, registers
  read/written), basic blocks.
* `sip.cfg`    - the control-flow graph of the basic blocks: dominators, natural loops, loop depth.
* `sip.latency` - fixed-latency distances measured on the GPU (tools/sass_latency.py): the table
  that lets stall counts go below what ptxas wrote.
* `sip.deps`   - the dependency model of a kernel: which instructions may swap, and the
  fixed-latency distances a reordering must keep.
* `sip.mutate` - immutable `Schedule` values and the classes of changes to them (global / shared /
  alu moves, control-code edits), hot blocks first; control-code repair; `apply`.
* `sip.search` - simulated annealing over any state space (what the tuner runs on schedules).
* `sip.cli`    - the `sip` command (disasm / inspect / mutate).

The engine works on bytes only: it imports neither torch, CuTeDSL nor rosekernels. Running
candidates on a GPU is the tuner's job (`sip_tune`); loading tuned cubins is rosekernels' own
(`rosekernels.tuned`, `rosekernels.jit`).
"""


class SipError(Exception):
    """Any input SIP cannot work with; the message says what is wrong and what to do."""
