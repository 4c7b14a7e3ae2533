"""sip.profile's stall reasons: the `stall_*` columns of Nsight Compute's source-page CSV read back per
instruction, added up per block, the two shares (the upper bound and what the moves aim at), and `sip hot`'s
per-block breakdown."""
import csv
import io
import random

import pytest
from sip_corpus import BASE, corpus, corpus_entry, synthetic_kernel  # noqa: F401

from sip import SipError, profile
from sip.cli import main
from sip.cubin import parse_cubin
from sip.sass import NO_SCOREBOARD, Control, disassemble

# The source page's columns as ncu writes them (a PC-sampling section, then one all-samples and one
# not-issued column per reason; sm_90 adds stall_gmma), with metric columns in between that the
# reader must skip.
REASON_COLUMNS = ["barrier", "branch_resolving", "dispatch", "drain", "gmma", "imc", "lg", "long_sb", "math",
                  "membar", "mio", "misc", "no_inst", "not_selected", "selected", "short_sb", "sleep", "tex", "wait"]
HEADER = (["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
           "# Samples", "Instructions Executed", "Thread Instructions Executed", "Address Space", "Access Operation"]
          + [f"stall_{r}" for r in REASON_COLUMNS] + [f"stall_{r} (Not Issued)" for r in REASON_COLUMNS])


def listing(kernel, reasons, name=None, base=BASE):
    """A source-page CSV of `kernel` whose instruction i has the samples `reasons[i]` ({column: n})."""
    out = io.StringIO()
    out.write(f'"Kernel Name","{name or kernel.name}",\n')
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEADER)
    for ins, by in zip(kernel.instructions, reasons):
        total = sum(by.values())
        text = f"{ins.predicate} {ins.opcode} {', '.join(ins.operands)}".strip()
        row = [f"{base + ins.offset:#x}", "      " + text, f"{total:,}", str(total - by.get("selected", 0)),
               str(total), "4096", "131072", "-", "-"]
        row += [f"{by.get(r, 0):,}" for r in REASON_COLUMNS]
        row += [str(by.get(r, 0) // 2) if r != "selected" else "0" for r in REASON_COLUMNS]  # must be ignored
        w.writerow(row)
    return out.getvalue()


C = Control(2, 1, NO_SCOREBOARD, NO_SCOREBOARD, 0, 0)


def loop_kernel():
    return synthetic_kernel([(t, C) for t in (
        "FADD R1, R2, R3 ;",        # block 0
        "MUFU.EX2 R4, R5 ;",        # block 1: the loop
        "FMUL R7, R4, R9 ;",
        "@P0 BRA 0x10 ;",
        "EXIT ;")])


def test_reasons_land_on_their_instructions_and_add_up_per_block():
    k = loop_kernel()
    by = [{"selected": 3}, {"math": 40, "selected": 10}, {"short_sb": 1200, "not_selected": 300},
          {"branch_resolving": 7, "wait": 5}, {}]
    text = listing(k, by)
    reasons = profile.stall_reasons(text, k)
    assert reasons == tuple(by)  # the (Not Issued) columns are not counted again
    assert profile.stall_samples(text, k) == tuple(sum(b.values()) for b in by)
    loop = profile.breakdown(reasons, k.blocks[1])
    assert loop == {"short_sb": 1200, "not_selected": 300, "math": 40, "selected": 10, "branch_resolving": 7,
                    "wait": 5}
    assert list(loop) == sorted(loop, key=lambda r: -loop[r])  # largest first
    total = sum(sum(b.values()) for b in by)
    assert profile.sensitive_share(reasons) == pytest.approx((1200 + 40 + 5) / total)
    assert profile.headroom(reasons) == pytest.approx(1 - (3 + 10 + 300) / total)  # all but the issue cycles


def test_sections_of_several_launches_add_up_and_names_are_normalised():
    k = loop_kernel()
    a = [{"sleep": 2}, {"gmma": 5}, {}, {}, {"drain": 1}]
    b = [{"sleep": 3}, {"gmma": 1, "long_sb": 4}, {}, {}, {}]
    reasons = profile.stall_reasons(listing(k, a) + listing(k, b), k)
    assert reasons[0] == {"sleeping": 5}  # ncu spells it stall_sleep and stall_sleeping
    assert reasons[1] == {"gmma": 6, "long_sb": 4}
    assert set(profile.REASONS) >= {"gmma", "short_sb", "long_sb", "wait", "math", "barrier", "selected"}
    renamed = listing(k, [{"misc": 9}] + a[1:]).replace('"stall_misc"', '"stall_tensor_future"')
    assert profile.stall_reasons(renamed, k)[0] == {"tensor_future": 9}  # a reason this does not know keeps its name


def test_a_listing_without_reason_columns_gives_samples_but_no_reasons():
    from sip_corpus import ncu_listing

    k = loop_kernel()
    text = ncu_listing(k, (1, 2, 3, 4, 5))
    assert profile.stall_samples(text, k) == (1, 2, 3, 4, 5)
    with pytest.raises(SipError, match="no stall_\\* columns"):
        profile.stall_reasons(text, k)


def test_unreadable_reason_cells_are_refused():
    k = loop_kernel()
    rows = listing(k, [{"wait": 1}] * 5).splitlines()
    cells = next(csv.reader([rows[2]]))
    cells[HEADER.index("stall_wait")] = "n/a"
    bad = "\n".join(rows[:2] + [",".join(f'"{c}"' for c in cells)] + rows[3:]) + "\n"
    short = "\n".join(rows[:2] + [rows[2].rsplit(",", 30)[0]] + rows[3:]) + "\n"
    for text in (bad, short):
        with pytest.raises(SipError, match="unreadable row"):
            profile.stall_reasons(text, k)


def test_headroom_bounds_the_sensitive_share_on_random_breakdowns():
    rng = random.Random(5)
    k = loop_kernel()
    for _ in range(50):
        by = [{r: rng.choice([0, 0, rng.randint(1, 5000)]) for r in REASON_COLUMNS} for _ in k.instructions]
        reasons = profile.stall_reasons(listing(k, by), k)
        norm = [{profile._reason("stall_" + r): n for r, n in b.items() if n} for b in by]
        total = sum(sum(b.values()) for b in norm)
        issued = sum(b.get("selected", 0) + b.get("not_selected", 0) for b in norm)
        want = sum(n for b in norm for r, n in b.items() if r in profile.SCHEDULE_SENSITIVE) / total if total else 0
        assert profile.sensitive_share(reasons) == pytest.approx(want)
        assert profile.headroom(reasons) == pytest.approx(1 - issued / total if total else 1.0)
        assert profile.sensitive_share(reasons) <= profile.headroom(reasons) + 1e-12


def test_the_waits_the_sync_relaxation_targets_count_toward_both_shares():
    """A kernel whose warps wait only on the tensor core and on a named barrier: the `sync` relaxation
    moves register-only work ahead of WARPGROUP.DEPBAR and BAR, so neither share may call it out of
    reach; a kernel that only issues has no headroom at all."""
    k = loop_kernel()
    waits = profile.stall_reasons(listing(k, [{"gmma": 600}, {"barrier": 300}, {"selected": 100}, {}, {}]), k)
    assert profile.sensitive_share(waits) == pytest.approx(0.9) and profile.headroom(waits) == pytest.approx(0.9)
    busy = profile.stall_reasons(listing(k, [{"selected": 50}, {"not_selected": 150}, {}, {}, {}]), k)
    assert profile.headroom(busy) == 0.0 and profile.sensitive_share(busy) == 0.0
    assert profile.headroom([{} for _ in k.instructions]) == 1.0  # no samples: nothing bounds it


def test_sip_hot_prints_each_hot_blocks_stall_breakdown(corpus, tmp_path, capsys):
    data = corpus_entry(corpus, "smem_tiled_gemm")
    kernel = disassemble(parse_cubin(data))["_Z15smem_tiled_gemmPfPKfS1_i"]
    hot = max(range(len(kernel.blocks)), key=lambda b: len(kernel.blocks[b]))
    by = [{"short_sb": 30, "selected": 10} if kernel.block_of[i] == hot else {"barrier": 1}
          for i in range(len(kernel.instructions))]
    cubin, csv_path = tmp_path / "k.cubin", tmp_path / "listing.csv"
    cubin.write_bytes(data)
    csv_path.write_text(listing(kernel, by, name="smem_tiled_gemm(float *, const float *, const float *, int)"))
    assert main(["hot", str(cubin), "--profile", str(csv_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(k for k, line in enumerate(lines) if line.strip().startswith(f"block {hot} "))
    assert lines[at + 1].strip() == "stalls: short_sb 75%, selected 25% (schedule-sensitive 75%)"
    n_hot, n = len(kernel.blocks[hot]), len(kernel.instructions)
    share = (30 * n_hot + (n - n_hot)) / (40 * n_hot + (n - n_hot))  # short_sb and barrier
    bound = 1 - 10 * n_hot / (40 * n_hot + (n - n_hot))  # all but the hot block's selected samples
    assert f"outside issue cycles: {bound:.1%} of all samples, the most any schedule change could save" in out
    assert ("schedule-sensitive stalls (barrier, dispatch, gmma, long_sb, math, mio, short_sb, wait), what SIP's moves "
            f"aim at: {share:.1%}") in out
    assert out.count("stalls: ") == 2
