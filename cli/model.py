"""`agent-recovery scripted-model serve --script FILE --port N`: the scripted model server."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    model = sub.add_parser("scripted-model", help="scripted OpenAI-compatible model server (tests, demo)")
    modelsub = model.add_subparsers(dest="scripted_model_command", required=True)
    serve = modelsub.add_parser(
        "serve", help="serve a JSON script until SIGINT/SIGTERM (expects MODEL_API_KEY when it is set)"
    )
    serve.add_argument("--script", required=True, metavar="FILE", help="JSON script: a list of rules")
    serve.add_argument("--port", type=int, required=True, metavar="N", help="port to listen on (0 picks a free one)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from doubles.scripted_model import run

    return run(args.script, args.host, args.port)
