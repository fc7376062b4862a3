"""`superfluid-conformance` against `superfluid-noded`, both as real processes: the suite passes on
the mock and on the builtin torch model, with and without a token; a transcript recorded during
the suite replays clean against a fresh node, and with exactly the expected differences against a
node with another identity and window."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from nodeproc import Noded

from linkf import transcript
from proto.linkf import msg_type

MOCK = ("--listen", "127.0.0.1:0", "--engine", "mock")
BUILTIN = ("--listen", "127.0.0.1:0", "--model", "builtin", "--device", "cpu", "--max-batch", "4")
TOKEN = "conformance-token"


def conformance(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_passed(out: subprocess.CompletedProcess, junit: Path) -> ET.Element:
    failed = [line for line in out.stdout.splitlines() if "  FAIL  " in line]
    assert out.returncode == 0 and not failed, "\n".join(failed) or out.stdout + out.stderr
    assert " 0 failed" in out.stdout.splitlines()[-1], out.stdout
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and int(suite.get("tests")) >= 30
    return suite


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The suite run against a mock node that records every connection; (run, transcript dir)."""
    home = tmp_path_factory.mktemp("noded")
    records = home / "transcripts"
    node = Noded([*MOCK, "--record", str(records)], home)
    try:
        out = conformance(node.addr, "--mock", "--junit", str(home / "junit.xml"))
    finally:
        node.kill()
    return out, home / "junit.xml", records


def test_the_suite_passes_against_noded_on_the_mock(recorded):
    out, junit, _ = recorded
    suite = assert_passed(out, junit)
    skipped = {c.get("name") for c in suite if c.find("skipped") is not None}
    assert skipped == {"noise-wrong-token", "noise-plaintext-refused"}, "only the token checks skip without one"


def test_the_suite_passes_against_noded_on_the_mock_with_a_token(noded, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    records = tmp_path / "transcripts"
    node = noded(*MOCK, "--auth-file", str(tmp_path / "token"), "--record", str(records))
    out = conformance(node.addr, "--mock", "--auth-file", str(tmp_path / "token"), "--junit", str(tmp_path / "j.xml"))
    suite = assert_passed(out, tmp_path / "j.xml")
    assert not [c for c in suite if c.find("skipped") is not None], "with a token nothing is skipped"
    node.kill()
    files = list(records.iterdir())
    assert files and not [f for f in files if TOKEN.encode() in f.read_bytes()], "a transcript holds the token"


def test_the_suite_passes_against_noded_on_the_builtin_model(noded, tmp_path):
    """With a token, so every check runs; the mock's runs cover a node without one."""
    (tmp_path / "token").write_text(TOKEN)
    auth = ("--auth-file", str(tmp_path / "token"))
    node = noded(*BUILTIN, *auth)
    out = conformance(node.addr, *auth, "--junit", str(tmp_path / "j.xml"))
    suite = assert_passed(out, tmp_path / "j.xml")
    skipped = {c.get("name") for c in suite if c.find("skipped") is not None}
    assert {"mock-tokens-exact", "mock-stage-exact"} <= skipped, "token-exact checks need --mock"


def generation_transcript(records: Path) -> Path:
    """The connection of `mock-tokens-exact`: generations and a stage forward, nothing else odd."""
    for path in sorted(records.iterdir()):
        types = {r.msg_type for r in transcript.read(path).records}
        if {msg_type.GENERATE_REQ, msg_type.STAGE_FORWARD_REQ} <= types and msg_type.RECONCILE not in types:
            return path
    raise AssertionError(f"no transcript of a generation among {sorted(records.iterdir())}")


def test_a_transcript_from_the_suite_replays_clean_against_a_fresh_node(recorded, noded):
    path = generation_transcript(recorded[2])
    fresh = noded(*MOCK)
    out = conformance("replay", str(path), "--target", fresh.addr)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1].startswith("0 difference(s)")


def test_a_replay_against_another_identity_and_window_shows_just_those(recorded, noded):
    path = generation_transcript(recorded[2])
    other = noded(*MOCK, "--identity", "someone-else", "--max-context", "1024")
    out = conformance("replay", str(path), "--target", other.addr)
    assert out.returncode == 1
    recorded_identity = transcript.read(path).header["identity"]
    differences = sorted(out.stdout.splitlines()[:-1])
    # A NODE_STATUS both sides happened to send differs in the window too; nothing else may.
    status = [d for d in differences if d.startswith("NODE_STATUS fixed figures:")]
    assert all("'max_context_tokens': 4096" in d and "'max_context_tokens': 1024" in d for d in status), status
    assert [d for d in differences if d not in status] == [
        "HELLO_ACK_F max_context_tokens: recorded 4096, replayed 1024",
        f"HELLO_ACK_F node_identity: recorded {recorded_identity!r}, replayed 'someone-else'",
    ]


def test_show_prints_the_header_and_one_line_a_frame(recorded):
    path = generation_transcript(recorded[2])
    out = conformance("show", str(path))
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[0].startswith("# side=node")
    assert len(lines) == 1 + len(transcript.read(path).records)
    assert "HELLO " in lines[1] and "auth=b''" in lines[1] and lines[1].endswith("(auth redacted)")
