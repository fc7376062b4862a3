"""Runs the scenarios against one node and says, for each, pass, fail or skip, and why.

A scenario fails when it finds a broken rule (`Violation`), when the node keeps it waiting past
a bound (`HeadTimeout`), or when the link fails under it; the reason is the exception's message.
"""

from __future__ import annotations

import enum
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from conformance import checks_fleet, checks_link, checks_serve
from conformance.head import FleetHead, HeadTimeout
from conformance.scenario import SCENARIOS, Context, Scenario, Skipped, Target, Violation
from linkf.errors import LinkFError


class Verdict(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclass(frozen=True)
class Outcome:
    name: str
    verdict: Verdict
    seconds: float
    why: str = ""


#: The modules that register scenarios, in the order their scenarios run: the link first, since
#: nothing else works without it.
MODULES = (checks_link.__name__, checks_serve.__name__, checks_fleet.__name__)


class UnknownScenario(ValueError):
    """--only named a scenario the suite does not have."""


def select(only: list[str] | None) -> list[Scenario]:
    """The scenarios to run, in suite order; `only` names some (all when empty)."""
    unknown = [name for name in only or () if name not in SCENARIOS]
    if unknown:
        raise UnknownScenario(f"no scenario named {', '.join(unknown)} (see --list)")
    ordered = sorted(SCENARIOS.values(), key=lambda s: MODULES.index(s.run.__module__))
    return [s for s in ordered if not only or s.name in only]


def run_suite(target: Target, only: list[str] | None = None, on_outcome=None) -> list[Outcome]:
    """Runs the chosen scenarios one after another; `on_outcome(outcome)` as each ends."""
    chosen = select(only)
    try:
        with FleetHead.connect(target.addr, auth=target.auth, timeout=target.timeout) as probe:
            hello = probe.node
    except (LinkFError, OSError) as e:
        return [Outcome(s.name, Verdict.FAIL, 0.0, f"no link to the node: {e}") for s in chosen]
    outcomes = []
    for s in chosen:
        outcome = run_one(s, target, hello)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


def run_one(s: Scenario, target: Target, hello) -> Outcome:
    if s.mock and not target.mock:
        return Outcome(s.name, Verdict.SKIP, 0.0, "token-exact checks need --mock")
    ctx = Context(target, hello)
    start = time.monotonic()
    verdict, why = Verdict.PASS, ""
    try:
        s.run(ctx)
    except Skipped as e:
        verdict, why = Verdict.SKIP, str(e)
    except (Violation, HeadTimeout) as e:
        verdict, why = Verdict.FAIL, str(e)
    except LinkFError as e:
        verdict, why = Verdict.FAIL, f"the link failed: {e}"
    except Exception as e:  # noqa: BLE001 - whatever the node made the kit trip on is its verdict
        verdict, why = Verdict.FAIL, f"{type(e).__name__}: {e}"
    finally:
        ctx.close()
    return Outcome(s.name, verdict, time.monotonic() - start, why)


def passed(outcomes: list[Outcome]) -> bool:
    """Whether nothing failed (skips are no failure)."""
    return all(o.verdict is not Verdict.FAIL for o in outcomes)


def table(outcomes: list[Outcome]) -> str:
    """The outcomes as a fixed-width table: scenario, verdict, time, why."""
    width = max([len("scenario")] + [len(o.name) for o in outcomes])
    lines = [f"{'scenario':<{width}}  verdict  time (s)  why"]
    for o in outcomes:
        lines.append(f"{o.name:<{width}}  {o.verdict.value:<7}  {o.seconds:8.2f}  {o.why}".rstrip())
    counts = {v: sum(o.verdict is v for o in outcomes) for v in Verdict}
    lines.append(
        f"{counts[Verdict.PASS]} passed, {counts[Verdict.FAIL]} failed, {counts[Verdict.SKIP]} skipped "
        f"in {sum(o.seconds for o in outcomes):.1f} s"
    )
    return "\n".join(lines)


def junit(outcomes: list[Outcome], target: Target) -> bytes:
    """The outcomes as a JUnit XML report, one testcase per scenario."""
    suite = ET.Element(
        "testsuite",
        name="superfluid-conformance",
        tests=str(len(outcomes)),
        failures=str(sum(o.verdict is Verdict.FAIL for o in outcomes)),
        skipped=str(sum(o.verdict is Verdict.SKIP for o in outcomes)),
        time=f"{sum(o.seconds for o in outcomes):.3f}",
        hostname=target.addr,
    )
    for o in outcomes:
        case = ET.SubElement(suite, "testcase", classname="conformance", name=o.name, time=f"{o.seconds:.3f}")
        if o.verdict is Verdict.FAIL:
            ET.SubElement(case, "failure", message=o.why).text = SCENARIOS[o.name].doc
        elif o.verdict is Verdict.SKIP:
            ET.SubElement(case, "skipped", message=o.why)
    return ET.tostring(suite, encoding="utf-8", xml_declaration=True)
