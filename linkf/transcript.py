"""Link F transcripts: one connection as a CBOR sequence, written by an `Endpoint.recorder`
(`superfluid-noded --record`) and read back by the conformance kit (`superfluid-conformance
replay` and `show`). It lives beside the endpoint it records, so the node and the kit share it
without depending on each other.

The first record is a header (what recorded it, the node's identity and model, the versions it
speaks, when the connection began); then one record per frame, in the order the recording end
sent or received it: `{t_ms, dir, version, msg_type, seq, payload}`, `dir` naming the sender
("head" or "node") and `payload` the postcard bytes after decryption. HELLO's `auth` is the fleet
token, so it is blanked before it is written (`redacted: true`): a transcript never holds it.

CBOR because a transcript is a list of small maps holding byte strings, which CBOR writes as
they are and any language reads; a sequence (records one after another) survives a node killed
mid-connection, losing at most the record being written.
"""

from __future__ import annotations

import dataclasses
import io
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cbor2

from proto import postcard
from proto.envelope import Frame
from proto.handshake import Hello
from proto.linkf import PAYLOAD_TYPES, decode_payload, msg_type, type_name

MAGIC = "superfluid-linkf-transcript"
FORMAT = 1
HEAD, NODE = "head", "node"


class TranscriptError(ValueError):
    """A file that is not a transcript this kit reads."""


@dataclass(frozen=True)
class Record:
    """One frame of a transcript."""

    t_ms: int
    sender: str
    version: int
    msg_type: int
    seq: int
    payload: bytes
    redacted: bool = False


@dataclass(frozen=True)
class Transcript:
    header: dict
    records: list[Record]


def redact(record_type: int, payload: bytes) -> tuple[bytes, bool]:
    """The payload as it may be written: a HELLO without its token (one that does not decode
    is dropped whole, since it might hold the token anywhere)."""
    if record_type != msg_type.HELLO:
        return payload, False
    try:
        hello = postcard.from_bytes(Hello, payload)
    except postcard.PostcardError:
        return b"", True
    return postcard.to_bytes(dataclasses.replace(hello, auth=b"")), True


class Recorder:
    """Writes one connection's transcript as its frames pass; an `Endpoint.recorder`. `side`
    is who records: its sent frames are its own, its received ones the peer's."""

    def __init__(self, out: io.BufferedWriter, side: str) -> None:
        self._out = out
        self._mine, self._theirs = (side, HEAD if side == NODE else NODE)
        self._start = time.monotonic()
        self._lock = threading.Lock()

    @classmethod
    def create(cls, directory: Path, name: str, side: str, **header: Any) -> Recorder:
        """A new transcript file `name` (made safe for a file name) in `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".cbor")
        recorder = cls(path.open("xb"), side)
        recorder._write(
            {"transcript": MAGIC, "format": FORMAT, "side": side, "started_unix_ms": time.time_ns() // 10**6, **header}
        )
        return recorder

    def __call__(self, direction: str, frame: Frame) -> None:
        payload, redacted = redact(frame.msg_type, frame.payload)
        record = {
            "t_ms": int((time.monotonic() - self._start) * 1000),
            "dir": self._mine if direction == "sent" else self._theirs,
            "version": frame.proto_version,
            "msg_type": frame.msg_type,
            "seq": frame.seq,
            "payload": payload,
        }
        if redacted:
            record["redacted"] = True
        self._write(record)

    def _write(self, item: dict) -> None:
        with self._lock:
            if not self._out.closed:
                cbor2.dump(item, self._out)
                self._out.flush()

    def close(self) -> None:
        with self._lock:
            self._out.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read(path: Path) -> Transcript:
    """The transcript in `path`; a record cut short at the end (a node killed mid-write) is left
    out."""
    data = Path(path).read_bytes()
    stream = io.BytesIO(data)
    items = []
    while stream.tell() < len(data):
        try:
            items.append(cbor2.load(stream))
        except cbor2.CBORDecodeError:
            break
    if not items or not isinstance(items[0], dict) or items[0].get("transcript") != MAGIC:
        raise TranscriptError(f"{path}: not a Link F transcript")
    if items[0].get("format") != FORMAT:
        raise TranscriptError(f"{path}: transcript format {items[0].get('format')}, this kit reads {FORMAT}")
    try:
        records = [
            Record(
                r["t_ms"], r["dir"], r["version"], r["msg_type"], r["seq"], bytes(r["payload"]),
                r.get("redacted", False),
            )
            for r in items[1:]
        ]
    except (KeyError, TypeError) as e:
        raise TranscriptError(f"{path}: a frame record without {e}") from None
    return Transcript(items[0], records)


def show(t: Transcript) -> list[str]:
    """The transcript decoded, a line for the header and one per frame."""
    header = ", ".join(f"{k}={v}" for k, v in t.header.items() if k not in ("transcript", "format"))
    lines = [f"# {header}"]
    for r in t.records:
        try:
            body = repr(decode_payload(r.msg_type, r.payload)) if r.msg_type in PAYLOAD_TYPES else r.payload.hex()
        except postcard.PostcardError as e:
            body = f"<{len(r.payload)} bytes that do not decode: {e}> {r.payload[:32].hex()}"
        mark = " (auth redacted)" if r.redacted else ""
        lines.append(f"{r.t_ms:>8} ms  {r.sender:<4} #{r.seq:<5} v{r.version} {type_name(r.msg_type):<18} {body}{mark}")
    return lines
