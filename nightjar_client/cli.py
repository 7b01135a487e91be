"""``nightjar generate``: send one prompt to a running stack and print the completion.

Text goes to stdout as tokens arrive with ``--stream``; ``--json`` prints one JSON object (or
one JSON line per delta with ``--stream``) for scripts. Errors go to stderr with the status
code; the exit code is 2 for a request the server (or this command) rejected as invalid,
1 for anything else that failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TextIO

from . import config
from .client import Client
from .errors import InvalidArgument, NightjarError
from .retry import RetryPolicy


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nightjar generate", description="Send one prompt to a running Nightjar gateway.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", help="the prompt text; '-' reads it from stdin")
    p.add_argument("--stream", action="store_true", help="print text as tokens arrive")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (None = server default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (deterministic), up to 2")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (None = random)")
    p.add_argument("--stop", nargs="+", default=[], metavar="S", help="stop before any of these strings")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence until --max-tokens")
    p.add_argument("--request-id", default="", help="id for tracing ('' = the gateway assigns one)")
    p.add_argument("--deadline-s", type=float, default=None, help="give up after this many seconds, retries included")
    p.add_argument("--retries", type=int, default=4, help="retries on UNAVAILABLE / RESOURCE_EXHAUSTED (queue full)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--target", default=config.env_target(),
                   help=f"gateway host:port (env {config.TARGET_ENV})")
    p.add_argument("--token", default=None, help=f"bearer token (env {config.TOKEN_ENV})")
    return p


def _print_error(err: NightjarError, as_json: bool, err_out: TextIO) -> None:
    if as_json:
        code = err.code.name if err.code is not None else "CLIENT"
        print(json.dumps({"error": code, "message": err.details}), file=err_out)
    else:
        print(f"nightjar generate: {err}", file=err_out)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err_out: TextIO | None = None,
         stdin: TextIO | None = None) -> int:
    out = out or sys.stdout
    err_out = err_out or sys.stderr
    args = build_parser().parse_args(argv)
    prompt = (stdin or sys.stdin).read() if args.prompt == "-" else args.prompt
    if args.retries < 0:
        print("nightjar generate: --retries must be >= 0", file=err_out)
        return 2
    token = args.token if args.token is not None else config.env_token()
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, request_id=args.request_id,
                  deadline_s=args.deadline_s)
    try:
        with Client(args.target, token=token, retry=RetryPolicy(max_attempts=args.retries + 1)) as client:
            if args.stream:
                _stream(client, prompt, params, args.json, out)
            else:
                completion = client.generate(prompt, **params)
                if args.json:
                    print(json.dumps(completion.to_dict()), file=out)
                else:
                    print(completion.text, file=out)
    except ValueError as exc:  # a malformed --target
        print(f"nightjar generate: {exc}", file=err_out)
        return 2
    except NightjarError as err:
        _print_error(err, args.json, err_out)
        return 2 if isinstance(err, InvalidArgument) else 1
    except KeyboardInterrupt:  # leaving the with-block cancelled the request on the server
        print(file=err_out)
        return 130
    return 0


def _stream(client: Client, prompt: str, params: dict, as_json: bool, out: TextIO) -> None:
    for delta in client.stream(prompt, **params):
        if as_json:
            d = asdict(delta)
            d["token_ids"] = list(delta.token_ids)
            print(json.dumps(d), file=out, flush=True)
        else:
            out.write(delta.text)
            out.flush()
    if not as_json:
        out.write("\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
