"""`superfluid-client`: talk to a running node by hand.

    superfluid-client hello HOST:PORT [--auth-file F]
    superfluid-client status HOST:PORT [--auth-file F]
    superfluid-client generate HOST:PORT [--auth-file F] (--prompt 1,2,3 | --text STR | --chat STR) [--model M]
                      [--max-new N] [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]

`hello` prints what the node says of itself in HELLO_ACK_F, `status` its next NODE_STATUS,
`generate` streams a generation (token ids, or text when the model's tokenizer is at hand) and
ends with its finish reason and rate. Every wait is bounded (`--timeout`); exit 1 when the node
fails to answer or the link fails, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time

from conformance.cli import OptionError, auth_from
from conformance.head import FleetHead, HeadTimeout, clock_id, reason
from linkf.errors import LinkFError
from proto.handshake import CapacitySummary
from proto.linkf import msg_type
from proto.params import GenParams

PROGRAM = "superfluid-client"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROGRAM, description="Talk to a superfluid node over Link F.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("hello", "print the node's HELLO_ACK_F"),
        ("status", "print the node's next NODE_STATUS"),
        ("generate", "stream a generation"),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("target", metavar="HOST:PORT")
        c.add_argument("--auth-file", help="the fleet token (the link is then Noise-encrypted)")
        c.add_argument("--timeout", type=float, default=10.0, help="seconds any wait lasts (default 10)")
    gen = sub.choices["generate"]
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt token ids, comma-separated")
    prompt.add_argument("--text", help="a plain-text prompt, through the model's tokenizer")
    prompt.add_argument("--chat", help="a user message, through the model's chat template")
    gen.add_argument(
        "--model",
        help="the model's directory, GGUF or alias, for its tokenizer (default: the model the node advertises)",
    )
    gen.add_argument("--max-new", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        auth = auth_from(args.auth_file)
        with FleetHead.connect(args.target, auth=auth, timeout=args.timeout) as head:
            return COMMANDS[args.command](head, args)
    except OptionError as e:
        print(f"{PROGRAM}: {e}", file=sys.stderr)
        return 2
    except (LinkFError, HeadTimeout, OSError) as e:
        print(f"{PROGRAM}: {args.target}: {e}", file=sys.stderr)
        return 1


def capacity_lines(c: CapacitySummary) -> list[str]:
    return [
        f"window      {c.max_context_tokens} tokens",
        f"lanes       {c.lanes_active} busy of {c.max_lanes}, {c.queue_depth} queued",
        f"kv blocks   {c.kv_blocks_used} used of {c.kv_blocks_total}",
        f"sessions    {c.active_sessions}",
        f"rates       decode {c.decode_tokens_per_s} tok/s, prefill {c.prefill_tokens_per_s} tok/s",
        f"memory      {gpu_memory(c)}, host {human_bytes(c.host_memory_bytes)}",
    ]


def gpu_memory(c: CapacitySummary) -> str:
    if not c.gpu_memory_bytes:
        return "no GPU"
    return f"GPU {human_bytes(c.gpu_memory_free_bytes)} free of {human_bytes(c.gpu_memory_bytes)}"


def human_bytes(n: int) -> str:
    """`n` bytes in binary units, three significant figures: 512 B, 1.50 KiB, 23.4 GiB."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    if unit == "B":
        return f"{n} B"
    digits = 2 if size < 10 else 1 if size < 100 else 0
    return f"{size:.{digits}f} {unit}"


def hello(head: FleetHead, args: argparse.Namespace) -> int:
    n = head.node
    lines = [
        f"node        {n.node_identity}",
        f"version     {n.chosen_version}",
        f"models      {', '.join(n.loadable_models)}",
        *capacity_lines(n.capacity),
        f"limits      frame {n.limits.max_frame} bytes, transfer window {n.limits.transfer_window}",
    ]
    print("\n".join(lines))
    return 0


def status(head: FleetHead, args: argparse.Namespace) -> int:
    msg = head.wait_for(msg_type.NODE_STATUS, args.timeout).msg
    print("\n".join([f"models      {', '.join(msg.loadable_models)}", *capacity_lines(msg.capacity)]))
    return 0


def generate(head: FleetHead, args: argparse.Namespace) -> int:
    codec = None
    if args.prompt is not None:
        try:
            prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
        except ValueError:
            print(f"{PROGRAM}: --prompt takes token ids, comma-separated", file=sys.stderr)
            return 2
    else:
        codec, prompt = text_prompt(args, head.node.loadable_models)
    session = clock_id()
    params = GenParams(args.temperature, args.top_p, args.min_p, args.top_k, args.seed)
    head.assign(session, params)
    head.append(session, prompt)
    start = time.monotonic()
    req = head.request(session, args.max_new)
    show = token_printer(codec)
    for tokens in head.stream(req, args.timeout):
        show(tokens)
    seconds = time.monotonic() - start
    g = head.generations[(session, req.generation_id)]
    head.revoke(session)
    rate = len(g.tokens) / seconds if seconds > 0 else 0.0
    print(f"\nfinish {reason(g.finish)}: {len(g.tokens)} tokens in {seconds:.2f} s ({rate:.1f} tok/s)", file=sys.stderr)
    return 0


def text_prompt(args: argparse.Namespace, advertised: list[str]):
    """The model's text codec and the prompt's token ids, for --text and --chat. Without
    --model the tokenizer is the one of the model the node advertises (an alias such as
    `make run`'s smollm2-135m-instruct, or a path that is also valid here)."""
    model = args.model or (advertised[0] if advertised else None)
    if model is None:
        raise OptionError("--text and --chat need --model, the model the node serves, for its tokenizer")
    from conformance.text import TextCodecError, load_text_codec  # here: it needs `tokenizers`

    try:
        codec = load_text_codec(model)
        if args.chat is not None:
            return codec, codec.chat([{"role": "user", "content": args.chat}])
        return codec, codec.encode(args.text)
    except TextCodecError as e:
        hint = "" if args.model else (
            f" (the node serves {model!r}; pass --model with its tokenizer's directory, GGUF or alias)"
        )
        raise OptionError(f"{e}{hint}") from None


def token_printer(codec):
    """Prints a run of tokens as it comes: as text with a codec, else as ids."""
    if codec is None:
        return lambda tokens: print(" ".join(map(str, tokens)), end=" ", flush=True)
    from conformance.text import StreamDecoder

    decoder = StreamDecoder(codec)
    return lambda tokens: print(decoder.feed(tokens), end="", flush=True)


COMMANDS = {"hello": hello, "status": status, "generate": generate}
