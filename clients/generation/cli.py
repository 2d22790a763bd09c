"""python -m clients generate|chat (the generate and chat commands): stream an answer of the text_generation model to the terminal.

    python -m clients generate "Once upon a time" --max-tokens 64
    python -m clients chat "What is the capital of France?" --system "Answer in one sentence."
    python -m clients chat            # interactive (stdin a terminal): history kept, Ctrl-D ends

``generate`` sends the prompt as it is; ``chat`` sends it as a user message and the server
applies the model's chat template. Without a prompt the text is read from stdin (``chat``
on a terminal: an interactive session). Pieces are printed as they arrive; a last line on
stderr gives the finish reason, the token counts and tokens/s (``--quiet`` drops it).
Ctrl-C cancels the request on the server.

Exit status: 0 on success, 1 when the server refuses the request or cannot be reached (its
message on stderr), 2 for a usage error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import IO, Any

from clients.cli_common import UsageError, add_url_argument, check_retry_options, fail, parse, silence_stdout
from clients.generation.client import GenerationClient, TextStream
from clients.generation.request import DEFAULT_MODEL
from clients.generation.response import Generation, GenerationError
from clients.transport import PROTOCOLS

COMMANDS = ("generate", "chat")
PROG = "python -m clients"


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``generate`` and ``chat`` commands."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,chat}")
    for name, text in (("generate", "complete a prompt as it is"), ("chat", "answer a message with the chat template")):
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument(
            "prompt", nargs="?", help="the prompt / message; none or '-' reads stdin (chat on a terminal: interactive)"
        )
        if name == "chat":
            c.add_argument("--system", help="system prompt, sent as the first message")
        g = c.add_argument_group("sampling")
        g.add_argument("--max-tokens", type=int, help="new tokens at most (server default when not given)")
        g.add_argument("--min-tokens", type=int)
        g.add_argument("--temperature", type=float, help="0 = greedy")
        g.add_argument("--top-p", type=float)
        g.add_argument("--top-k", type=int)
        g.add_argument("--seed", type=int, help="seed of the sampler: the same seed gives the same answer")
        g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable); it is not printed")
        g.add_argument("--repetition-penalty", type=float)
        g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past the end-of-sequence token")
        c.add_argument("--protocol", choices=PROTOCOLS, default="grpc", help="default grpc")
        add_url_argument(c, "grpc")
        c.add_argument("--model", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
        c.add_argument("--timeout", type=float, help="seconds to wait for each response (the first included)")
        c.add_argument(
            "--retries",
            type=int,
            help="retries before the first response when the server is unavailable "
            "(default 3; 0 = none); after it an error is final",
        )
        c.add_argument("--deadline", type=float, help="seconds for all attempts until the first response (default --timeout)")
        c.add_argument("--no-stream", action="store_true", help="ask for the whole answer in one response")
        c.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
        c.add_argument("-v", "--verbose", action="store_true", help="log each request to stderr")
    return p


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options given on the command line (those left out are the server's defaults)."""
    names = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "ignore_eos")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def read_prompt(args: argparse.Namespace, stdin: IO[str]) -> str | None:
    """The prompt from the argument or stdin; None means an interactive chat."""
    if args.prompt not in (None, "-"):
        return args.prompt
    if getattr(stdin, "isatty", lambda: False)():
        if args.command == "chat" and args.prompt is None:
            return None
        logging.getLogger(PROG).warning("reading the prompt from stdin; end with Ctrl-D")
    text = stdin.read()
    if not text.strip():
        raise UsageError("no prompt: give one as an argument or on stdin")
    return text.removesuffix("\n")


def summary(g: Generation) -> str:
    """The stderr line after an answer: finish reason, tokens, tokens/s, time to first token."""
    parts = [f"finish_reason={g.finish_reason or 'unknown'}"]
    if g.num_input_tokens is not None:
        parts.append(f"prompt_tokens={g.num_input_tokens}")
    if g.num_output_tokens is not None:
        parts.append(f"output_tokens={g.num_output_tokens}")
    if g.tokens_per_s is not None:
        parts.append(f"tokens/s={g.tokens_per_s:.1f}")
    if g.time_to_first_token_s is not None:
        parts.append(f"ttft={g.time_to_first_token_s:.3f}s")
    parts.append(f"total={g.total_time_s:.3f}s")
    return " ".join(parts)


def stream_to(pieces: TextStream, out: IO[str]) -> Generation:
    """Write each piece as it arrives (flushed); the stream's Generation at the end.

    Ctrl-C (KeyboardInterrupt) closes the stream, which cancels the request, and propagates.
    """
    with pieces:
        for piece in pieces:
            out.write(piece)
            out.flush()
    assert pieces.result is not None
    return pieces.result


def _one(client: GenerationClient, args: argparse.Namespace, request: Any, out: IO[str], err: IO[str]) -> Generation:
    sampling = sampling_from_args(args)
    if args.command == "chat":
        if args.no_stream:
            g = client.chat(request, args.system, **sampling)
            out.write(g.text)
        else:
            g = stream_to(client.chat_stream(request, args.system, **sampling), out)
    elif args.no_stream:
        g = client.generate(request, **sampling)
        out.write(g.text)
    else:
        g = stream_to(client.stream(request, **sampling), out)
    out.write("\n")
    out.flush()
    if not args.quiet:
        err.write(summary(g) + "\n")
        err.flush()
    return g


def interactive(client: GenerationClient, args: argparse.Namespace, out: IO[str], err: IO[str], read=input) -> int:
    """A chat session on the terminal: history kept; Ctrl-C cancels an answer, Ctrl-D ends."""
    history: list[dict[str, str]] = []
    err.write("chat with the model; Ctrl-C stops an answer, Ctrl-D (or /exit) ends, /reset clears the history\n")
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history.clear()
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            g = _one(client, args, history, out, err)
        except KeyboardInterrupt:
            history.pop()  # the answer was cancelled: ask again from the same point
            out.write("\n")
            err.write("(cancelled)\n")
            continue
        except GenerationError as exc:
            history.pop()
            fail(PROG, str(exc), 1, err)
            continue
        history.append({"role": "assistant", "content": g.text})


def main(
    argv: Sequence[str] | None = None, stdin: IO[str] | None = None, stdout: IO[str] | None = None, stderr: IO[str] | None = None
) -> int:
    """Run ``generate`` or ``chat``; returns the exit status (0 ok, 1 server error, 2 usage, 130 Ctrl-C)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    args = parse(build_parser(), argv)
    if isinstance(args, int):  # argparse has printed the usage or --help already
        return args
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG, stream=stderr, format="%(name)s: %(message)s")
    try:
        prompt = read_prompt(args, stdin)
        # Checked before connecting: a bad option is a usage error, not a server one.
        sampling_from_args(args)
        check_retry_options(args)
        client = GenerationClient(
            args.url, args.protocol, args.model, timeout_s=args.timeout, retries=args.retries, deadline_s=args.deadline
        )
    except (UsageError, ValueError, TypeError) as exc:
        return fail(PROG, str(exc), 2, stderr)
    except KeyboardInterrupt:
        return fail(PROG, "interrupted", 130, stderr)
    with client:
        if prompt is None:
            return interactive(client, args, stdout, stderr)
        try:
            _one(client, args, prompt, stdout, stderr)
        except GenerationError as exc:
            stdout.flush()
            return fail(PROG, str(exc), 1, stderr)
        except KeyboardInterrupt:
            stdout.write("\n")
            return fail(PROG, "interrupted; the request was cancelled", 130, stderr)
        except BrokenPipeError:  # e.g. `... | head`: the reader has what it wanted
            silence_stdout()
            return 1
    return 0


def generate_command() -> int:
    """The ``generate`` console script: ``python -m clients generate`` by a shorter name."""
    return main(["generate", *sys.argv[1:]])


def chat_command() -> int:
    """The ``chat`` console script: ``python -m clients chat`` by a shorter name."""
    return main(["chat", *sys.argv[1:]])
