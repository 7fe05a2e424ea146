"""A stdio MCP server of our own for the MCP tests: plain JSON-RPC lines on stdin/stdout, the
standard library only (it starts in a few tens of milliseconds), and tools that misbehave on
purpose.

Tools: ``charge`` (answers), ``hang`` (answers after ``seconds``; a ``notifications/cancelled``
for it is recorded), ``block`` (like ``hang``, but on the thread that reads stdin: the server
notices nothing, not even its stdin closing, until it answers), ``die`` (exits without
answering: the server dies mid-call), ``refuse`` (answers with a JSON-RPC error), ``whoami``
(quotes MCP_TOKEN in its result, and on stderr), ``leak`` (an ``isError`` result quoting
MCP_TOKEN), ``resource`` (an embedded text resource), ``image`` (a 48 kB PNG beside a text
part), ``pid`` (the server's process id), ``grow`` (adds the tool ``grown`` and sends
``notifications/tools/list_changed``) and ``huge_error`` (a 200 kB ``isError`` text).

Options: ``--no-init`` (never answers ``initialize``). MCP_RECORD (a file path) gets one line per
event: ``start <pid>``, ``call <tool>``, ``cancelled <request id>``.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
from typing import Any

_out_lock = threading.Lock()
_grown = False


def record(line: str) -> None:
    path = os.environ.get("MCP_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def send(message: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def text(value: str, *, error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value}], "isError": error}


def tool(name: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"the {name} tool",
        "inputSchema": {"type": "object", "properties": properties or {}},
    }


def tools() -> list[dict[str, Any]]:
    listed = [
        tool("charge", {"amount_cents": {"type": "integer"}}),
        tool("hang", {"seconds": {"type": "number"}}),
        tool("block", {"seconds": {"type": "number"}}),
        tool("die"),
        tool("refuse"),
        tool("whoami"),
        tool("leak"),
        tool("resource"),
        tool("image"),
        tool("pid"),
        tool("grow"),
        tool("huge_error"),
    ]
    if _grown:
        listed.append(tool("grown"))
    return listed


def call(request_id: Any, name: str, args: dict[str, Any]) -> None:
    global _grown
    record(f"call {name}")
    token = os.environ.get("MCP_TOKEN", "")
    if name == "charge":
        send({"jsonrpc": "2.0", "id": request_id, "result": text(f"charged {args.get('amount_cents')}")})
    elif name in ("hang", "block"):
        time.sleep(float(args.get("seconds", 3600)))
        send({"jsonrpc": "2.0", "id": request_id, "result": text("woke up")})
    elif name == "die":
        os._exit(3)
    elif name == "refuse":
        send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32602, "message": "amount is required"}})
    elif name == "whoami":
        sys.stderr.write(f"serving whoami with token {token}\n")
        sys.stderr.flush()
        send({"jsonrpc": "2.0", "id": request_id, "result": text(f"my token is {token}")})
    elif name == "leak":
        send({"jsonrpc": "2.0", "id": request_id, "result": text(f"upstream said 401 for {token}", error=True)})
    elif name == "resource":
        content = [
            {"type": "text", "text": "the report:"},
            {
                "type": "resource",
                "resource": {"uri": "file:///report.txt", "mimeType": "text/plain", "text": "all green"},
            },
            {
                "type": "resource",
                "resource": {"uri": "file:///blob.bin", "mimeType": "application/pdf", "blob": "AAAA"},
            },
        ]
        send({"jsonrpc": "2.0", "id": request_id, "result": {"content": content, "isError": False}})
    elif name == "image":
        png = base64.b64encode(b"\x89PNG" + b"\0" * (48 * 1024 - 4)).decode("ascii")
        content = [{"type": "text", "text": "the chart:"}, {"type": "image", "data": png, "mimeType": "image/png"}]
        send({"jsonrpc": "2.0", "id": request_id, "result": {"content": content, "isError": False}})
    elif name == "pid":
        send({"jsonrpc": "2.0", "id": request_id, "result": text(str(os.getpid()))})
    elif name == "grow":
        _grown = True
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        send({"jsonrpc": "2.0", "id": request_id, "result": text("grown")})
    elif name == "huge_error":
        send({"jsonrpc": "2.0", "id": request_id, "result": text("x" * 200_000, error=True)})
    else:
        send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32602, "message": f"unknown tool {name}"}})


def main() -> None:
    no_init = "--no-init" in sys.argv
    record(f"start {os.getpid()}")
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        method, request_id = message.get("method"), message.get("id")
        params = message.get("params") or {}
        if method == "initialize":
            if no_init:
                continue
            result = {
                "protocolVersion": params.get("protocolVersion"),
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "misbehaving", "version": "1"},
            }
            send({"jsonrpc": "2.0", "id": request_id, "result": result})
        elif method == "notifications/cancelled":
            record(f"cancelled {params.get('requestId')}")
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": request_id, "result": {"tools": tools()}})
        elif method == "tools/call":
            args = (params.get("name"), params.get("arguments") or {})
            if args[0] == "block":
                call(request_id, *args)
            else:
                threading.Thread(target=call, args=(request_id, *args), daemon=True).start()
        elif method == "ping":
            send({"jsonrpc": "2.0", "id": request_id, "result": {}})
        elif request_id is not None:
            send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": f"no method {method}"}})


if __name__ == "__main__":
    main()
