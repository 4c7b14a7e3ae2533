"""tools/sass_latency.py: the chains it generates, compiles and checks on the CPU, the stall rewrites
it runs, and (on an H200) the table it measures."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from sip_corpus import nvcc_path

from sip import latency
from sip.cubin import parse_cubin
from sip.sass import disassemble

TOOL = Path(__file__).resolve().parents[2] / "tools" / "sass_latency.py"
OPS = ["FFMA", "IMAD", "SHF", "ISETP", "IADD3", "HMMA"]
UNITS = 6


def _load():
    spec = importlib.util.spec_from_file_location("sass_latency", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tool = _load()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if nvcc_path() is None:
        pytest.skip("nvcc not found: the chains are compiled with it")
    chains = tool.chains(OPS)
    cubin = tool.compile_ptx(tool.ptx(chains, UNITS), tmp_path_factory.mktemp("chains"))
    return cubin, {a.chain.name: a for a in tool.analyse(cubin, chains)}


def test_the_selection_keeps_chains_made_of_the_named_ops():
    names = {c.name for c in tool.chains(["FFMA", "IMAD"])}
    assert names == {"FFMA", "IMAD", "FFMA>IMAD"}
    assert {"ISETP.guard", "HMMA.F16", "HMMA.BF16", "IADD3.carry", "DFMA>DMUL"} <= {c.name for c in tool.chains()}
    assert not tool.chains(["NOPE"])


def test_each_chain_compiles_to_the_dependent_chain_it_describes(built):
    cubin, analyses = built
    a = analyses["FFMA>IMAD"]
    assert not a.problems and a.links == 2 * UNITS - 1
    pairs = {p.key: p for p in a.pairs}
    assert set(pairs) == {"FFMA>IMAD:R", "IMAD>FFMA:R"}
    assert len(pairs["FFMA>IMAD:R"].sites) == UNITS and len(pairs["IMAD>FFMA:R"].sites) == UNITS - 1
    assert all(2 <= p.ptxas_stall <= 15 for p in pairs.values())
    guard = {p.key for p in analyses["ISETP.guard"].pairs}
    assert "ISETP>IMAD@:@P" in guard or "ISETP>IADD3@:@P" in guard  # a guard predicate, predicated consumer
    hmma = analyses["HMMA.F16"].pairs
    assert [p.key for p in hmma] == ["HMMA.16816.F32>HMMA.16816.F32:R"]
    assert hmma[0].ptxas_stall > 15 and all(between for _, between in hmma[0].sites)  # NOPs make up the distance


def test_identities_and_variable_latency_are_not_measured(built):
    cubin, analyses = built
    a = analyses["FFMA>SHF"]  # SHF rotates a float chain by 32: an identity
    assert [p.key for p in a.pairs] == ["FFMA>SHF:R"] and any("identity" in m for m in a.problems)
    assert {p.key for p in analyses["SHF"].pairs} == {"SHF>SHF:R"}  # the integer chain rotates by 7


@pytest.mark.parametrize("chain, key", [("FFMA>IMAD", "FFMA>IMAD:R"), ("HMMA.F16", "HMMA.16816.F32>HMMA.16816.F32:R")])
def test_a_variant_puts_every_site_of_the_pair_at_the_distance_and_changes_nothing_else(built, chain, key):
    cubin, analyses = built
    a = analyses[chain]
    pair = next(p for p in a.pairs if p.key == key)
    before = disassemble(parse_cubin(cubin))[a.kernel].instructions
    for k in (pair.ptxas_stall - 1, 2):
        data = tool.variant(cubin, a, pair, k)
        after = disassemble(parse_cubin(data))[a.kernel].instructions
        touched = set()
        for p, between in pair.sites:
            assert sum(after[x].control.stall for x in (p, *between)) == k
            touched |= {p, *between}
        for x, (i, j) in enumerate(zip(before, after)):
            assert j.word & ((1 << 105) - 1) == i.word & ((1 << 105) - 1)
            if x not in touched:
                assert j.word == i.word
        saved = sum(pair.ptxas_stall - k for _ in pair.sites)
        assert tool.expected_cycles(data, a) == tool.expected_cycles(cubin, a) - saved
    assert tool.variant(cubin, a, pair, 0) is None


def test_build_writes_the_ptx_the_cubin_and_the_plan(tmp_path):
    if nvcc_path() is None:
        pytest.skip("nvcc not found")
    assert tool.main(["--build", str(tmp_path), "--ops", "FFMA,LOP3", "--units", "4"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan) == {"FFMA", "LOP3", "FFMA>LOP3"}
    assert plan["LOP3"]["pairs"]["LOP3>LOP3:R"]["candidates"][-1] == 1  # down to 1 cycle
    assert (tmp_path / "chains.cubin").read_bytes()[:4] == b"\x7fELF"
    with pytest.raises(SystemExit):
        tool.main(["--build", str(tmp_path / "x"), "--ops", "NOPE"])
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_the_h200_measures_a_table_sip_can_load(tmp_path):
    out = tmp_path / "table.json"
    assert tool.main(["--out", str(out), "--ops", "FFMA,IMAD,ISETP,IADD3", "--trials", "2", "--blocks", "4"]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["producer"], r["consumer"], r["file"]): r for r in doc["pairs"]}
    assert ("FFMA", "FFMA", "R") in rows and ("H200" in doc["device"] or "H100" in doc["device"])
    for r in doc["pairs"]:
        top = r["runs"][str(r["ptxas_stall"])]
        assert top["correct"] and top["clean"], r  # ptxas' own schedule is right and runs as counted
        if r["latency"] is not None:
            assert 1 <= r["latency"] <= r["ptxas_stall"]
    table = latency.load(out)
    assert table.raw("FFMA", "FFMA", "R") == rows[("FFMA", "FFMA", "R")]["latency"]
