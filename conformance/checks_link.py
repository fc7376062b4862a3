"""Scenarios about the link itself: HELLO and its answer, version negotiation, Noise, and input
that breaks the protocol (linkf-wire.md §1, §4, §5; node-behaviour.md §1.1)."""

from __future__ import annotations

import time

from conformance.raw import raw_frame
from conformance.scenario import Context, Violation, check, scenario, skip
from linkf.errors import Closed, LinkFError, Protocol, TimedOut
from proto.envelope import MAX_FRAME
from proto.handshake import Hello, LinkRole
from proto.linkf import LinkFLimits, PolicyUpdateMsg, TelemetryMsg, msg_type

LIMITS = LinkFLimits(max_frame=MAX_FRAME, transfer_window=8, max_transfer=1 << 26, transfer_budget=1 << 28)
U32_MAX = 2**32 - 1
#: How long a node may take to hang up on a peer that broke the rules.
HANG_UP_S = 3.0
PROMPT = [9, 8, 7, 6, 5]


@scenario("hello-ack")
def hello_ack(ctx: Context) -> None:
    """HELLO_ACK_F: version 3 for an offer of (2, 3), an identity, the model, the spec's limits."""
    h = ctx.hello
    check(h.chosen_version == 3, f"chose version {h.chosen_version} for an offer of (2, 3)")
    check(h.node_identity, "node_identity is empty")
    check(h.loadable_models and all(h.loadable_models), f"loadable_models is {h.loadable_models!r}")
    check(h.feature_flags == 0, f"feature_flags {h.feature_flags}, not 0")
    check(h.limits == LIMITS, f"limits {h.limits}, not {LIMITS}")
    check(h.capacity.max_sessions == U32_MAX, f"max_sessions {h.capacity.max_sessions}, not 2^32-1")
    check(
        h.capacity.kv_blocks_used <= h.capacity.kv_blocks_total,
        f"kv_blocks_used {h.capacity.kv_blocks_used} > kv_blocks_total {h.capacity.kv_blocks_total}",
    )


def _versions_serve(ctx: Context, versions: tuple[int, int], want: int) -> None:
    head = ctx.head(versions=versions)
    check(head.node.chosen_version == want, f"offered {versions}, the node chose {head.node.chosen_version}")
    session, _ = ctx.place(head, PROMPT)
    g = head.generate(session, 4, timeout=ctx.target.timeout)
    check(len(g.tokens) <= 4 and g.finish is not None, "no generation on the negotiated version")
    wrong = {r.frame.proto_version for r in head.received} - {want}
    check(not wrong, f"frames on a version-{want} link carry version(s) {sorted(wrong)}")


@scenario("version-3")
def version_3(ctx: Context) -> None:
    """An offer of (3, 3) runs at version 3, and every frame says so."""
    _versions_serve(ctx, (3, 3), 3)


@scenario("version-2")
def version_2(ctx: Context) -> None:
    """An offer of (2, 2), the public Rust head's, runs at version 2, and every frame says so."""
    _versions_serve(ctx, (2, 2), 2)


def _refused(ctx: Context, what: str, **kw) -> None:
    """The node must refuse this HELLO (or handshake) by hanging up, never answer it."""
    try:
        head = ctx.head(timeout=HANG_UP_S, **kw)
    except Protocol as e:
        raise Violation(f"{what}: the node answered with a HELLO_ACK_F ({e.reason})") from None
    except TimedOut:
        raise Violation(f"{what}: the node neither answered nor hung up within {HANG_UP_S:g} s") from None
    except LinkFError:
        return
    raise Violation(f"{what}: the node accepted it (chose version {head.node.chosen_version})")


@scenario("version-none-in-common")
def version_none(ctx: Context) -> None:
    """An offer of (4, 5) shares no version with the node: it hangs up."""
    _refused(ctx, "an offer of (4, 5)", versions=(4, 5))


@scenario("role-not-head")
def role_not_head(ctx: Context) -> None:
    """A HELLO whose link_role is not HeadDaemon is refused."""
    _refused(ctx, "a HELLO as NodeAgent", role=LinkRole.NodeAgent)


@scenario("noise-wrong-token")
def noise_wrong_token(ctx: Context) -> None:
    """A head keyed with another token gets no link (Noise fails; nothing is answered)."""
    if not ctx.target.auth:
        skip("the node has no token")
    _refused(ctx, "another token", auth=ctx.target.auth + b"-not-it")


@scenario("noise-plaintext-refused")
def noise_plaintext(ctx: Context) -> None:
    """A keyed node answers nothing to a plaintext HELLO, even one carrying the right token (it
    reads it as a Noise message: it may wait for the rest until its handshake timeout)."""
    if not ctx.target.auth:
        skip("the node has no token")
    link = ctx.raw(noise=False)
    hello = Hello(proto_versions=(2, 3), link_role=LinkRole.HeadDaemon, auth=ctx.target.auth)
    link.send_msg(msg_type.HELLO, hello)
    deadline = time.monotonic() + HANG_UP_S
    try:
        while time.monotonic() < deadline:
            check(not link.read(deadline - time.monotonic()), "the node answered a plaintext HELLO in plaintext")
    except Closed:
        pass


def _bad_input(ctx: Context, data: bytes, *, after_hello: bool = True) -> None:
    """The node hangs up on the peer that sent `data`, and only on it."""
    good = ctx.head()
    session, _ = ctx.place(good, PROMPT)
    bad = ctx.raw()
    if after_hello:
        bad.hello(ctx.target.auth, timeout=ctx.target.timeout)
    bad.send(data)
    check(bad.hung_up(HANG_UP_S), f"the node kept the link open {HANG_UP_S:g} s after it")
    g = good.generate(session, 4, timeout=ctx.target.timeout)
    check(g.finish is not None, "another head's link stopped serving")


BAD_INPUT = {
    "bad-unknown-required-type": (raw_frame(0x0100, seq=2), "a frame of an unknown required type (0x0100)"),
    "bad-class-byte": (raw_frame(msg_type.KEEPALIVE, class_byte=0, seq=2), "a droppable type sent as required"),
    "bad-frame-too-large": (raw_frame(msg_type.APPEND_CONTENT, length=MAX_FRAME + 1, seq=2), "a length past 16 MiB"),
    "bad-length-under-header": (raw_frame(msg_type.KEEPALIVE, length=3, seq=2), "a length under the 21-byte header"),
    "bad-payload": (raw_frame(msg_type.SESSION_ASSIGN, b"\x01\x02", seq=2), "a SESSION_ASSIGN that does not decode"),
}


def _register_bad_input(name: str, data: bytes, what: str) -> None:
    def run(ctx: Context) -> None:
        _bad_input(ctx, data)

    run.__doc__ = f"After HELLO, {what}: the node drops that link, and serves the others."
    scenario(name)(run)


for _name, (_data, _what) in BAD_INPUT.items():
    _register_bad_input(_name, _data, _what)


@scenario("bad-frame-before-hello")
def frame_before_hello(ctx: Context) -> None:
    """A frame other than HELLO first: the node drops that link, and serves the others."""
    _bad_input(ctx, raw_frame(msg_type.GENERATE_CANCEL, b"\x01\x01"), after_hello=False)


@scenario("ignored-types")
def ignored_types(ctx: Context) -> None:
    """An unknown droppable frame, TELEMETRY and POLICY_UPDATE are skipped; the link serves on."""
    head = ctx.head()
    head.endpoint.send(0x8003)
    head.endpoint.send(msg_type.TELEMETRY, TelemetryMsg(spans=b"span"))
    head.endpoint.send(msg_type.POLICY_UPDATE, PolicyUpdateMsg(policy_version=3, envelope=b"x"))
    session, _ = ctx.place(head, PROMPT)
    check(head.generate(session, 4, timeout=ctx.target.timeout).finish is not None, "no generation after them")

