"""The `sip` command line."""
import re
import struct

import pytest
import json

from sip_corpus import CORPUS_SOURCES, compile_cu, corpus, corpus_entry  # noqa: F401

from sip import latency
from sip.cli import main
from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.mutate import move_class
from sip.sass import CONTROL_MASK, disassemble

GEMM = "_Z15smem_tiled_gemmPfPKfS1_i"


@pytest.fixture
def gemm_cubin(corpus, tmp_path):
    path = tmp_path / "gemm.cubin"
    path.write_bytes(corpus_entry(corpus, "smem_tiled_gemm"))
    return path


def test_disasm_prints_offsets_control_codes_and_text(gemm_cubin, capsys):
    assert main(["disasm", str(gemm_cubin), "--kernel", GEMM]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/ (\[B[-0-5]{6}:R[-0-5]:W[-0-5]:[-Y]:S\d\d\]) (.+) ;", out)
    kernel = disassemble(parse_cubin(gemm_cubin.read_bytes()))[GEMM]
    assert len(lines) == len(kernel.instructions)
    for (offset, control, text), ins in zip(lines, kernel.instructions):
        assert int(offset, 16) == ins.offset and control == str(ins.control)
        assert text.startswith((ins.predicate + " " if ins.predicate else "") + ins.opcode)
    assert "LDG.E.CONSTANT" in out and "BAR.SYNC" in out


def test_loops_lists_the_unrolled_gemm_loop(gemm_cubin, capsys):
    assert main(["loops", str(gemm_cubin), "--kernel", GEMM, "--opcodes", "2"]) == 0
    out = capsys.readouterr().out
    (line,) = re.findall(r"  loop at 0x[0-9a-f]+ \(block \d+\), depth 1: .*", out)
    # ptxas unrolled the tile loop into one block (test_cfg): its instructions, stalls and top two opcodes.
    kernel = disassemble(parse_cubin(gemm_cubin.read_bytes()))[GEMM]
    body = [kernel.instructions[i] for i in kernel.blocks[int(re.search(r"block (\d+)", line).group(1))]]
    top = sorted({i.base for i in body}, key=lambda op: (-sum(i.base == op for i in body), op))[:2]
    assert f"1 blocks, {len(body)} instructions, {sum(i.control.stall for i in body)} stall cycles; " in line
    assert line.endswith(", ".join(f"{op} {sum(i.base == op for i in body)}" for op in top)) and "FFMA 64" in line


def test_inspect_reports_each_kernel(gemm_cubin, capsys):
    assert main(["inspect", str(gemm_cubin)]) == 0
    out = capsys.readouterr().out
    m = re.search(rf"{GEMM}: (\d+) instructions, (\d+) blocks, (\d+) pinned, (\d+) movable, "
                  r"(\d+) legal moves now", out)
    assert m
    kernel = disassemble(parse_cubin(gemm_cubin.read_bytes()))[GEMM]
    model = DependencyModel(kernel)
    assert int(m.group(1)) == len(kernel.instructions) and int(m.group(2)) == len(kernel.blocks)
    assert int(m.group(3)) == sum(1 for f in model.facts if f.pin)
    assert 0 < int(m.group(5)) <= 2 * int(m.group(4))


def test_mutate_is_reproducible_and_writes_a_valid_cubin(gemm_cubin, tmp_path, capsys):
    outs = []
    for k, seed in enumerate((7, 7, 8)):
        out = tmp_path / f"out{k}.cubin"
        assert main(["mutate", str(gemm_cubin), "-o", str(out), "--steps", "50", "--seed", str(seed),
                     "--moves", "global,shared"]) == 0
        outs.append(out.read_bytes())
    assert "applied 50 of 50 moves" in capsys.readouterr().out
    original = gemm_cubin.read_bytes()
    assert outs[0] == outs[1] != original and outs[2] != outs[0]
    rewritten = disassemble(parse_cubin(outs[0]))[GEMM]
    before = disassemble(parse_cubin(original))[GEMM]
    assert sorted(i.opcode for i in rewritten.instructions) == sorted(i.opcode for i in before.instructions)


def test_mutate_with_zero_steps_copies_the_cubin(gemm_cubin, tmp_path):
    out = tmp_path / "same.cubin"
    assert main(["mutate", str(gemm_cubin), "-o", str(out), "--steps", "0", "--seed", "1"]) == 0
    assert out.read_bytes() == gemm_cubin.read_bytes()


def test_bad_inputs_give_clear_errors(gemm_cubin, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a cubin")
    assert main(["inspect", str(text)]) == 1
    assert "not an ELF file" in capsys.readouterr().err
    assert main(["disasm", str(gemm_cubin), "--kernel", "nope"]) == 1
    err = capsys.readouterr().err
    assert "'nope' not found" in err and GEMM in err
    assert main(["inspect", str(tmp_path / "missing.cubin")]) == 1
    assert "No such file" in capsys.readouterr().err
    old = tmp_path / "old.cubin"
    old.write_bytes(compile_cu(CORPUS_SOURCES / "warp_reduce_atomics.cu", tmp_path, "sm_80"))
    assert main(["mutate", str(old), "-o", str(tmp_path / "x.cubin"), "--steps", "1", "--seed", "1"]) == 1
    assert "unsupported architecture sm_80" in capsys.readouterr().err


def _host_object(*cubins: bytes) -> bytes:
    """An x86-64 ELF object (EM_X86_64, 62) whose data holds one fatbin per cubin, as CuTeDSL's exported
    objects (a rosekernels compile-cache entry's .o) embed theirs."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<HH", header, 0x10, 1, 62)  # ET_REL, EM_X86_64
    blobs = []
    for cubin in cubins:
        payload = cubin + bytes(-len(cubin) % 8)
        entry = bytearray(64)
        struct.pack_into("<HHIQ", entry, 0, 2, 0x101, 64, len(payload))  # an ELF entry for sm_90
        struct.pack_into("<I", entry, 28, 90)
        blobs.append(struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 64 + len(payload)) + bytes(entry) + payload)
    return bytes(header) + b"\x00" * 200 + b"\x00".join(blobs) + b"\x00" * 64


def test_a_host_object_that_embeds_one_cubin_is_read_as_that_cubin(gemm_cubin, tmp_path, capsys):
    obj = tmp_path / "entry.o"
    obj.write_bytes(_host_object(gemm_cubin.read_bytes()))
    assert main(["disasm", str(gemm_cubin), "--kernel", GEMM]) == 0
    direct = capsys.readouterr().out
    assert main(["disasm", str(obj), "--kernel", GEMM]) == 0
    got = capsys.readouterr()
    assert got.out == direct and "reading the cubin it embeds" in got.err
    for count in (0, 2):  # nothing to read, or a choice only the user can make: say how to get a cubin
        obj.write_bytes(_host_object(*[gemm_cubin.read_bytes()] * count))
        assert main(["disasm", str(obj)]) == 1
        err = capsys.readouterr().err
        assert "ELF machine 62" in err and "rosekernels-cache cubin" in err


def test_mutate_refuses_negative_steps(gemm_cubin, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["mutate", str(gemm_cubin), "-o", str(tmp_path / "out.cubin"), "--steps", "-3", "--seed", "1"])
    assert e.value.code == 2 and "must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "out.cubin").exists()


def test_mutate_of_a_kernel_without_a_legal_move_says_so_and_writes_nothing(corpus, tmp_path, capsys):
    path = tmp_path / "pipeline.cubin"  # cp.async pipeline: a few movable instructions, none can move
    path.write_bytes(corpus_entry(corpus, "cp_async_pipeline"))
    out = tmp_path / "out.cubin"
    assert main(["mutate", str(path), "-o", str(out), "--steps", "50", "--seed", "1"]) == 1
    assert "has no legal move" in capsys.readouterr().err and not out.exists()


def test_mutate_moves_only_the_named_classes(gemm_cubin, tmp_path, capsys):
    before = disassemble(parse_cubin(gemm_cubin.read_bytes()))[GEMM]
    out = tmp_path / "alu.cubin"
    assert main(["mutate", str(gemm_cubin), "-o", str(out), "--steps", "60", "--seed", "3", "--moves", "alu"]) == 0
    assert "applied 60 of 60 moves (seed 3, alu)" in capsys.readouterr().out
    after = disassemble(parse_cubin(out.read_bytes()))[GEMM]
    assert [_plain(i) for i in before.instructions] != [_plain(i) for i in after.instructions]
    # every swap moves an alu instruction: the others keep their order among themselves
    others = [[_plain(i) for i in k.instructions if move_class(i) != "alu"] for k in (before, after)]
    assert others[0] == others[1]
    out = tmp_path / "control.cubin"
    assert main(["mutate", str(gemm_cubin), "-o", str(out), "--steps", "60", "--seed", "3",
                 "--moves", "control.yield,control.reuse"]) == 0
    edited = disassemble(parse_cubin(out.read_bytes()))[GEMM]
    changed = 0
    for i, j in zip(before.instructions, edited.instructions):
        assert (i.word ^ j.word) & ~(CONTROL_MASK << 105) == 0  # control bits only
        changed += i.word != j.word
    assert changed > 10


def test_mutate_refuses_unknown_classes_and_stall_lowering_without_a_table(gemm_cubin, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.cubin"
    args = ["mutate", str(gemm_cubin), "-o", str(out), "--steps", "5", "--seed", "1"]
    assert main(args + ["--moves", "global,warp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown move class 'warp'" in err
    monkeypatch.setattr(latency, "DEFAULT_PATH", tmp_path / "no_table.json")
    for moves in ("control", "all", "control.stall"):
        assert main(args + ["--moves", moves]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs a latency table" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(args + ["--moves", "all", "--latency-table", str(bad)]) == 1
    assert "not a SIP latency table" in capsys.readouterr().err
    assert not out.exists()
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": latency.FORMAT, "pairs": [
        {"producer": "FFMA", "consumer": "FFMA", "file": "R", "latency": 2}]}))
    assert main(args + ["--moves", "all", "--latency-table", str(table)]) == 0 and out.exists()


def test_inspect_counts_per_class(gemm_cubin, capsys):
    assert main(["inspect", str(gemm_cubin), "--moves", "global,shared,alu,control.yield"]) == 0
    out = capsys.readouterr().out
    counts = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"  (\w+): (\d+) movable, (\d+) legal moves now", out)}
    assert set(counts) == {"global", "shared", "alu", "control"}
    assert all(0 < legal for _, legal in counts.values())
    assert counts["control"][0] >= counts["alu"][0] + counts["shared"][0] + counts["global"][0]


def _plain(ins):
    return ins.predicate, ins.opcode, tuple(op.replace(".reuse", "") for op in ins.operands)


def test_hot_and_mutate_read_a_profilers_listing(gemm_cubin, tmp_path, capsys):
    """`sip hot` ranks the blocks by their PC samples; `sip mutate --profile` changes only the sampled
    block when every sample lies there (the floor weight of the other blocks is 1% of the mean)."""
    from sip_corpus import ncu_listing as listing

    kernel = disassemble(parse_cubin(gemm_cubin.read_bytes()))[GEMM]
    hot = max(range(len(kernel.blocks)), key=lambda b: len(kernel.blocks[b]))
    counts = [50 if kernel.block_of[i] == hot else 0 for i in range(len(kernel.instructions))]
    csv_path = tmp_path / "listing.csv"
    csv_path.write_text(listing(kernel, counts))
    assert main(["hot", str(gemm_cubin), "--profile", str(csv_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    start = kernel.instructions[kernel.blocks[hot].start].offset
    assert f"block {hot} at {start:#06x}: 100.0% of the samples" in out and out.count("block ") == 2
    out_cubin = tmp_path / "hot.cubin"
    assert main(["mutate", str(gemm_cubin), "-o", str(out_cubin), "--steps", "5", "--seed", "2", "--moves", "alu",
                 "--profile", str(csv_path)]) == 0
    after = disassemble(parse_cubin(out_cubin.read_bytes()))[GEMM]
    moved = {kernel.block_of[i.index] for i, j in zip(kernel.instructions, after.instructions) if i.word != j.word}
    assert moved == {hot}
    csv_path.write_text(listing(kernel, counts).replace("FFMA", "FMUL", 1))
    assert main(["hot", str(gemm_cubin), "--profile", str(csv_path)]) == 1
    assert "another build" in capsys.readouterr().err
