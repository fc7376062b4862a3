"""The kit catches faults: each double breaks one rule in front of a real node, and the scenario
that owns the rule reports it, while the same scenarios pass through a proxy that breaks nothing."""

import faults
import pytest

from conformance.scenario import Target
from conformance.suite import Verdict, run_suite

#: double -> (the scenario that must report it, a phrase of its reason)
CASES = {
    "never sends Finish": (faults.NeverFinishes, "generate-finish", "no Finish"),
    "reuses an event_seq": (faults.ReusesEventSeq, "event-seq", "sent twice"),
    "answers a wrong token": (faults.WrongToken, "mock-tokens-exact", "tokens"),
    "ignores GENERATE_CANCEL": (faults.IgnoresCancel, "cancel", "after GENERATE_CANCEL"),
    "drops the link on a decline": (faults.DropsOnDecline, "decline-unknown-session", "dropped the link"),
    "sends tokens after self-fencing": (faults.TokensAfterFence, "self-fence", "after the lease ran out"),
    "retransmits an acked event": (faults.RetransmitsAcked, "reconcile-retransmits-unacked", "already acknowledged"),
}
SCENARIOS = [scenario for _, scenario, _ in CASES.values()]


@pytest.fixture
def proxied(node):
    proxies = []

    def through(fault: faults.Fault) -> str:
        proxies.append(faults.FaultProxy(node.addr, fault))
        return proxies[-1].addr

    yield through
    for p in proxies:
        p.stop()


def test_the_scenarios_pass_through_a_proxy_that_breaks_nothing(proxied):
    outcomes = run_suite(Target(proxied(faults.Fault()), mock=True, timeout=5.0), SCENARIOS)
    assert [(o.name, o.verdict, o.why) for o in outcomes if o.verdict is not Verdict.PASS] == []


@pytest.mark.parametrize("case", CASES)
def test_each_fault_is_reported_by_its_scenario(proxied, case):
    fault, scenario, phrase = CASES[case]
    (outcome,) = run_suite(Target(proxied(fault()), mock=True, timeout=5.0), [scenario])
    assert outcome.verdict is Verdict.FAIL, f"{case} went unnoticed by {scenario}"
    assert phrase in outcome.why, outcome.why
