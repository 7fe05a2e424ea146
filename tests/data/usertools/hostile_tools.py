"""Tools that behave as real tool code does when it goes wrong (argparse exiting on bad input,
the shop's own Redis answering WRONGTYPE, binary output), for the real-worker tests of what a
tool's failure is: its TOOL result, never the worker's end."""

from __future__ import annotations

import argparse
import os
import shlex

import redis

from harness.tools import tool


@tool(read_only=True)
def pool_pid() -> int:
    """The id of the process the tool runs in."""
    return os.getpid()


@tool
def report(command_line: str) -> str:
    """Run the report command with the given command line."""
    parser = argparse.ArgumentParser(prog="report")
    parser.add_argument("--days", type=int, required=True)
    args = parser.parse_args(shlex.split(command_line))
    return f"report over {args.days} days"


@tool
def interrupt() -> str:
    """A tool that is interrupted as if by Ctrl-C."""
    raise KeyboardInterrupt


@tool
def shop_queue_push(item: str) -> int:
    """Push an item on the shop's queue (the shop's own Redis)."""
    shop = redis.Redis.from_url(os.environ["SHOP_REDIS_URL"])
    shop.set("shop:queue", "not a list")
    return int(shop.lpush("shop:queue", item))


@tool
def thumbnail() -> bytes:
    """A JPEG header, as binary tools return."""
    return b"\xff\xd8\xff\xe0"
