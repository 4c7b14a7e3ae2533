"""Issue 40's GPU pieces, cheapest first: the varlen attention workload (the campaign's first kernel)
checks itself against the float64 reference and runs in the tuner's worker; ncu's listing carries the
stall reasons `sip hot` and the campaign read, and a second profile of the same (workload, cubin) is
read from $SIP_PROFILE_CACHE instead of running ncu again. About two minutes on an H200."""
import math
import time

import pytest

from sip import cubin as elf, profile, sass
from sip_tune import compute, probe, workloads
from sip_tune.runner import Runner

pytestmark = pytest.mark.gpu


def test_the_varlen_workload_checks_itself_and_runs_in_the_tuners_worker():
    import torch

    factory = compute.varlen_factory(64, False, lengths=(300, 7, 513))
    w = factory()
    args = w.make_args(3)
    assert args[3].isnan().all() and args[4].isnan().all()  # poisoned before the launch
    w.run(w.kernel.fn, args)
    torch.cuda.synchronize()
    w.check(args)  # every sequence against its float64 reference
    args[3][0, 5, 0, 0] = 1e4  # a wrong element is caught
    with pytest.raises(AssertionError):
        w.check(args)
    sample = w.sample(11)
    w.run(w.kernel.fn, sample)
    torch.cuda.synchronize()
    w.check(sample)
    with Runner(compute.varlen_factory(64, False)) as runner:  # the campaign's timing shape
        runner.start()
        ev = runner.evaluate(w.kernel.cubin, seed=5)
    assert ev.status == "ok" and abs(ev.rel - 1) < 0.05, ev


def test_the_listing_has_stall_reasons_and_the_cache_profiles_once(tmp_path, monkeypatch):
    factory = workloads.factory("qk_norm", "decode")
    original = factory().kernel.cubin
    monkeypatch.setenv(probe.PROFILE_CACHE_ENV, str(tmp_path))
    t0 = time.monotonic()
    listing = probe.profile(factory, original)
    first = time.monotonic() - t0
    parsed = elf.parse_cubin(original)
    kernel = sass.disassemble_kernel(parsed, parsed.main_kernel().name)
    reasons = profile.stall_reasons(listing, kernel)
    total = profile.breakdown(reasons, range(len(reasons)))
    print(f"\nqk_norm decode stall reasons: {total}; headroom (upper bound) {profile.headroom(reasons):.1%}, "
          f"what SIP's moves aim at {profile.sensitive_share(reasons):.1%}")
    assert sum(total.values()) == sum(profile.stall_samples(listing, kernel)) > 0
    assert "selected" in total
    unknown = set(total) - set(profile.REASONS)
    assert not unknown, f"ncu lists reasons sip.profile does not describe: {unknown}"
    t0 = time.monotonic()
    assert probe.profile(factory, original) == listing
    assert time.monotonic() - t0 < min(first / 4, 5) and len(list(tmp_path.glob("*.csv"))) == 1
    assert math.isfinite(profile.headroom(reasons))
