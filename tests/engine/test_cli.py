"""The `sip` command line."""
import re

import pytest
from sip_corpus import CORPUS_SOURCES, compile_cu, corpus, corpus_entry  # noqa: F401

from sip.cli import main
from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.sass import disassemble

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
                     "--include-shared"]) == 0
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
