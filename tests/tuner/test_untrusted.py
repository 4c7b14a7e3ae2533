"""An untrusted relaxation (sip.mutate.UNTRUSTED) is validated on at least UNTRUSTED_SAMPLES fresh samples
before the tuner stores anything, whatever it is asked for; trusted classes keep the samples asked for."""
from sip import mutate
from sip_tune.tuning import TuneConfig


def test_untrusted_relaxations_are_validated_on_the_full_sample_count():
    assert mutate.UNTRUSTED and mutate.UNTRUSTED_SAMPLES == 100_000
    for name in sorted(mutate.UNTRUSTED):
        for asked in (1, 5_000, 99_999):
            assert TuneConfig(budget_iters=1, moves=f"alu,{name}", samples=asked).validation_samples == 100_000
        assert TuneConfig(budget_iters=1, moves=f"alu,{name}", samples=250_000).validation_samples == 250_000
        assert TuneConfig(budget_iters=1, moves=f"all,{name}").validation_samples == 100_000
    assert TuneConfig(budget_iters=1, moves="alu", samples=5_000).validation_samples == 5_000
    assert TuneConfig(budget_iters=1, samples=5_000).validation_samples == 5_000
    assert TuneConfig(budget_iters=1).validation_samples == 10_000
