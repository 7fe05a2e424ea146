"""The tool room: the decorator, schemas from type hints, validation,
the ToolContext, what a failing tool becomes, user modules and the checks at start."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

from harness.agents import _load, load_at_start
from harness.errors import AgentConfigError, Cancelled, DeadlineExceeded, ToolError
from harness.tools import (
    REGISTRY,
    ToolContext,
    ToolDefinitionError,
    load_tool_modules,
    lookup,
    run_inline,
    tool,
    tool_names,
    unregister,
)
from models.base import utcnow
from models.errors import LeaseLost
from settings import get_settings

USERTOOLS = Path(__file__).resolve().parent.parent / "data" / "usertools"


@pytest.fixture
def scratch() -> Iterator[list[str]]:
    """Names of tools a test registers; forgotten after it."""
    names: list[str] = []
    yield names
    for name in names:
        unregister(name)


@pytest.fixture
def usertools(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """tests/data/usertools importable; its modules and tools forgotten after the test."""
    monkeypatch.syspath_prepend(str(USERTOOLS))
    before = set(REGISTRY)
    yield
    for name in set(REGISTRY) - before:
        unregister(name)
    for module in [m for m in sys.modules if m.startswith("acme_")]:
        del sys.modules[module]
    get_settings.cache_clear()
    _load.cache_clear()


class Address(BaseModel):
    city: str
    zip_code: str | None = None


def ctx(**kw: Any) -> ToolContext:
    return ToolContext(kw.pop("session_id", 7), kw.pop("tool_call_id", "call_1"), kw.pop("deadline", None), **kw)


def test_a_plain_function_becomes_a_tool_with_its_name_docstring_and_a_schema_from_its_hints(
    scratch: list[str],
) -> None:
    @tool
    def ship_to(address: Address, copies: Annotated[int, Field(ge=1, le=5)] = 1, note: str | None = None) -> str:
        """Ship the order to an address."""
        return f"{copies} to {address.city}"

    scratch.append("ship_to")
    entry = lookup("ship_to")
    assert entry is not None and entry.run is not None
    assert entry.description == "Ship the order to an address."
    assert (entry.read_only, entry.idempotent) == (False, False)
    schema = entry.spec()["function"]["parameters"]
    assert schema["type"] == "object" and schema["required"] == ["address"]
    assert schema["properties"]["copies"]["minimum"] == 1 and schema["properties"]["copies"]["maximum"] == 5
    assert "Address" in json.dumps(schema["$defs"])
    assert ship_to(Address(city="Oslo")) == "1 to Oslo"  # still a plain function
    assert run_inline("ship_to", '{"address": {"city": "Oslo"}, "copies": 2}', ctx(), ("ship_to",)) == "2 to Oslo"


def test_an_async_tool_runs_to_its_end(scratch: list[str]) -> None:
    import asyncio

    @tool
    async def slow_double(n: int) -> int:
        await asyncio.sleep(0.01)
        return n * 2

    scratch.append("slow_double")
    assert run_inline("slow_double", '{"n": 21}', ctx(), ("slow_double",)) == "42"


def test_name_read_only_and_idempotent_are_declared_in_the_decorator(scratch: list[str]) -> None:
    @tool(name="fetch_page", read_only=True)
    def fetch(url: str) -> str:
        """Fetch a page."""
        return url

    @tool(idempotent=True)
    def put_record(key: str) -> str:
        return key

    scratch.extend(["fetch_page", "put_record"])
    fetched, put = lookup("fetch_page"), lookup("put_record")
    assert fetched is not None and (fetched.read_only, fetched.idempotent) == (True, False)
    assert put is not None and (put.read_only, put.idempotent) == (False, True)
    assert lookup("fetch") is None


def test_arguments_that_do_not_validate_are_the_tool_result_and_the_function_never_runs(scratch: list[str]) -> None:
    ran: list[int] = []

    @tool
    def count_to(n: Annotated[int, Field(ge=1)]) -> str:
        ran.append(n)
        return str(n)

    scratch.append("count_to")
    allowed = ("count_to",)
    assert run_inline("count_to", '{"n": 0}', ctx(), allowed) == (
        "error: invalid arguments for tool 'count_to': n: Input should be greater than or equal to 1"
    )
    missing = run_inline("count_to", '{"m": "secret-value"}', ctx(), allowed)
    assert missing.startswith("error: invalid arguments") and "n: Field required" in missing
    assert "m: Extra inputs are not permitted" in missing and "secret-value" not in missing
    assert run_inline("count_to", "not json", ctx(), allowed) == (
        "error: the arguments of tool 'count_to' are not valid JSON (Expecting value at character 0): send the "
        'call again with the arguments as one JSON object; its parameters: {"n": "integer"}, required: n'
    )
    assert run_inline("count_to", "[1]", ctx(), allowed).startswith(
        "error: the arguments of tool 'count_to' are not a JSON object: send the call again"
    )
    assert ran == []


def test_the_first_parameter_annotated_tool_context_gets_the_call_and_is_not_in_the_schema(
    scratch: list[str],
) -> None:
    seen: list[ToolContext] = []

    @tool
    def remember(context: ToolContext, what: str) -> dict[str, Any]:
        seen.append(context)
        return {"what": what, "left": round(context.seconds_left() or 0)}

    scratch.append("remember")
    entry = lookup("remember")
    assert entry is not None and list(entry.parameters["properties"]) == ["what"]
    call = ctx(deadline=utcnow() + timedelta(seconds=60))
    result = run_inline("remember", '{"what": "x"}', call, ("remember",))
    assert json.loads(result) == {"what": "x", "left": 60}  # not text: sent as JSON
    assert seen == [call]


def test_the_idempotency_key_is_the_same_for_one_call_in_every_process_and_differs_between_calls() -> None:
    import hashlib

    first = ToolContext(42, "call_abc", None)
    again = ToolContext(42, "call_abc", utcnow(), lambda: True, "child")  # a recovery of that call
    assert first.idempotency_key == again.idempotency_key == hashlib.sha256(b"42:call_abc").hexdigest()
    assert ToolContext(42, "call_abd", None).idempotency_key != first.idempotency_key
    assert ToolContext(43, "call_abc", None).idempotency_key != first.idempotency_key


def test_a_local_calls_key_is_in_its_installations_namespace_and_a_second_installation_never_shares_it() -> None:
    import hashlib

    from harness.callids import new_call_id

    call_id = new_call_id()
    assert call_id.startswith("tc_") and len(call_id) == 35 and call_id.isprintable()
    here = ToolContext(42, call_id, None, namespace="inst-a")
    recovered = ToolContext(42, call_id, utcnow(), lambda: True, "child", namespace="inst-a")
    assert here.idempotency_key == recovered.idempotency_key == hashlib.sha256(f"inst-a:{call_id}".encode()).hexdigest()
    # A rebuilt database (a new installation id) under the same session and call id: a new key.
    assert ToolContext(42, call_id, None, namespace="inst-b").idempotency_key != here.idempotency_key
    assert new_call_id() != call_id


def test_a_tool_that_raises_becomes_a_tool_error_with_type_and_message_without_traceback_or_secret(
    scratch: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODEL_API_KEY", "sk-canary-123456")
    get_settings.cache_clear()

    @tool
    def explode(x: int) -> str:
        raise ValueError(f"bad x {x} with key sk-canary-123456\nsecond line")

    @tool
    def refuse() -> str:
        raise ToolError("the shop is closed")

    scratch.extend(["explode", "refuse"])
    try:
        result = run_inline("explode", '{"x": 3}', ctx(), ("explode",))
    finally:
        get_settings.cache_clear()
    assert result == "error: ValueError: bad x 3 with key [redacted] second line"
    assert "Traceback" not in result
    assert run_inline("refuse", "{}", ctx(), ("refuse",)) == "error: the shop is closed"


def test_cancellation_the_deadline_and_a_lost_lease_propagate_out_of_a_tool(
    scratch: list[str],
) -> None:
    # A database error raised INSIDE a tool used to propagate too; it is the tool's own
    # database, so it is now the call's result (the next test).
    errors: dict[str, BaseException] = {
        "cancel_me": Cancelled(),
        "late": DeadlineExceeded(),
        "lose_lease": LeaseLost(),
    }

    def raiser_of(exc: BaseException) -> Any:
        def raiser() -> str:
            raise exc

        return raiser

    for name, exc in errors.items():
        tool(name=name)(raiser_of(exc))
        scratch.append(name)
        with pytest.raises(type(exc)):
            run_inline(name, "{}", ctx(), (name,))


def test_whatever_a_tool_raises_besides_cancel_deadline_and_lease_is_its_result_and_the_loop_goes_on(
    scratch: list[str],
) -> None:
    import argparse

    import psycopg2.errors
    import redis.exceptions
    from sqlalchemy.exc import OperationalError

    def argparse_exit() -> str:
        parser = argparse.ArgumentParser(prog="report", exit_on_error=True)
        parser.add_argument("--n", type=int)
        parser.parse_args(["--n", "many"])
        return "unreachable"

    cases: dict[str, tuple[Any, str]] = {
        "shop_redis": (
            redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
            "error: ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value",
        ),
        "shop_pg": (psycopg2.errors.UndefinedTable('relation "orders" does not exist'), "error: UndefinedTable: "),
        "shop_pg_down": (
            OperationalError("SELECT 1", {}, Exception("server closed the connection")),
            "error: OperationalError: ",
        ),
        "shop_socket": (ConnectionResetError("peer reset"), "error: ConnectionResetError: peer reset"),
        "bye": (SystemExit(2), "error: SystemExit: 2"),
        "ctrl_c": (KeyboardInterrupt(), "error: KeyboardInterrupt"),
    }

    def raiser_of(exc: BaseException) -> Any:
        def raiser() -> str:
            raise exc

        return raiser

    for name, (exc, expected) in cases.items():
        tool(name=name)(raiser_of(exc))
        scratch.append(name)
        assert run_inline(name, "{}", ctx(), (name,)).startswith(expected), name
    tool(name="report")(argparse_exit)
    scratch.append("report")
    assert run_inline("report", "{}", ctx(), ("report",)) == "error: SystemExit: 2"


def test_bytes_a_tool_returns_are_text_when_utf8_and_base64_when_not_never_an_error(scratch: list[str]) -> None:
    @tool(name="blob")
    def blob(kind: str) -> Any:
        return {"raw": b"\xff\xfe\x00", "utf8": "caf\u00e9".encode()} if kind == "nested" else b"\xff\xd8\xff\xe0"

    scratch.append("blob")
    assert run_inline("blob", '{"kind": "top"}', ctx(), ("blob",)) == "base64:/9j/4A=="
    nested = json.loads(run_inline("blob", '{"kind": "nested"}', ctx(), ("blob",)))
    assert nested["raw"] in ("//4A", "__4A") and nested["utf8"] == "Y2Fmw6k="


def test_an_unknown_or_refused_tool_is_a_tool_error() -> None:
    assert run_inline("nope", "{}", ctx(), ("nope",)) == "error: tool 'nope' is not available"
    assert run_inline("echo", '{"text": "x"}', ctx(), ("wait",)) == "error: tool 'echo' is not available"
    assert run_inline("delegate", "{}", ctx(), ("delegate",)) == "error: tool 'delegate' is not available"


def test_echo_and_wait_are_decorated_tools_that_keep_their_arguments_and_behaviour() -> None:
    assert tool_names()[:4] == ("delegate", "delegate_followup", "echo", "wait")
    echo, wait = lookup("echo"), lookup("wait")
    assert echo is not None and echo.read_only and echo.parameters["required"] == ["text"]
    assert wait is not None and not wait.read_only and not wait.idempotent
    assert run_inline("echo", '{"text": "hi"}', ctx(), ("echo",)) == "hi"
    assert run_inline("wait", '{"seconds": 0.05}', ctx(), ("wait",)) == "waited 0.05 seconds"
    assert run_inline("wait", '{"seconds": -1}', ctx(), ("wait",)).startswith("error: invalid arguments")
    with pytest.raises(Cancelled):
        run_inline("wait", '{"seconds": 5}', ctx(cancelled=lambda: True), ("wait",))
    with pytest.raises(DeadlineExceeded):
        run_inline("wait", '{"seconds": 5}', ctx(deadline=utcnow() - timedelta(seconds=1)), ("wait",))


def test_a_second_function_under_a_taken_name_is_refused_naming_both_modules(scratch: list[str]) -> None:
    with pytest.raises(ToolDefinitionError) as info:

        @tool(name="echo")
        def my_echo(text: str) -> str:
            return text

    assert "'echo' is defined twice" in str(info.value) and "harness.tools.builtins" in str(info.value)
    assert __name__ in str(info.value)


@pytest.mark.parametrize(
    ("define", "expected"),
    [
        ("def f(*args: int) -> str: ...", "*args"),
        ("def f(x) -> str: ...", "has no type hint"),
        ("def f(x: int, c: ToolContext) -> str: ...", "only the first parameter"),
    ],
)
def test_a_tool_whose_schema_cannot_be_built_is_refused_naming_the_tool_and_module(define: str, expected: str) -> None:
    namespace: dict[str, Any] = {"ToolContext": ToolContext, "__name__": "user.module"}
    exec(define, namespace)
    with pytest.raises(ToolDefinitionError) as info:
        tool(name="broken_tool")(namespace["f"])
    assert "tool 'broken_tool' in module user.module" in str(info.value) and expected in str(info.value)
    assert "broken_tool" not in REGISTRY


def test_tool_modules_are_imported_and_their_tools_offered(usertools: None) -> None:
    assert load_tool_modules(("acme_tools",)) == ("acme_tools",)
    entry = lookup("refund_order")
    assert entry is not None and entry.idempotent and entry.module == "acme_tools"
    result = run_inline("refund_order", '{"order_id": 7, "amount_cents": 500}', ctx(), ("refund_order",))
    assert result == f"refunded 500 cents on order 7 with key {ctx().idempotency_key}"
    assert run_inline("check_inventory", '{"sku": "A-1"}', ctx(), ("check_inventory",)) == (
        "error: ConnectionRefusedError: inventory service refused the request for A-1"
    )


def test_an_installed_package_offers_tools_through_the_entry_point_group(
    usertools: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # An installed distribution as importlib.metadata finds one: a .dist-info folder on sys.path.
    dist = tmp_path / "acme_shop-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-shop\nVersion: 1.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text("[agent_recovery.tools]\nshop = acme_tools\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "lookup_order" not in REGISTRY
    assert load_tool_modules(()) == ("acme_tools",)
    entry = lookup("lookup_order")
    assert entry is not None and entry.read_only and entry.module == "acme_tools"


def _start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, modules: str, agents_toml: str) -> str:
    path = tmp_path / "agents.toml"
    path.write_text(agents_toml, encoding="utf-8")
    monkeypatch.setenv("TOOL_MODULES", modules)
    monkeypatch.setenv("AGENTS_FILE", str(path))
    get_settings.cache_clear()
    _load.cache_clear()
    with pytest.raises(AgentConfigError) as info:
        load_at_start()
    return str(info.value)


def test_an_agent_listing_an_unknown_tool_stops_the_start_naming_agent_tool_and_modules(
    usertools: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    message = _start(
        monkeypatch, tmp_path, "acme_tools", '[agents.shop]\nsystem_prompt = "p"\ntools = ["lookup_ordr"]\n'
    )
    assert "agent 'shop' lists tool 'lookup_ordr'" in message and "acme_tools" in message


def test_a_duplicate_tool_name_stops_the_start_naming_the_tool_both_modules_and_the_agent(
    usertools: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    message = _start(
        monkeypatch,
        tmp_path,
        "acme_tools, acme_dup_tools",
        '[agents.shop]\nsystem_prompt = "p"\ntools = ["lookup_order"]\n',
    )
    assert "'lookup_order' is defined twice: in module acme_tools and in module acme_dup_tools" in message
    assert "agent shop" in message


def test_a_tool_whose_schema_cannot_be_built_stops_the_start(
    usertools: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    message = _start(
        monkeypatch, tmp_path, "acme_bad_schema", '[agents.shop]\nsystem_prompt = "p"\ntools = ["hold_lock"]\n'
    )
    assert "tool 'hold_lock' in module acme_bad_schema: its JSON schema cannot be built" in message
    assert "agent shop" in message


def test_a_tool_module_that_cannot_be_imported_stops_the_start(
    usertools: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    message = _start(monkeypatch, tmp_path, "acme_missing", '[agents.shop]\nsystem_prompt = "p"\n')
    assert "TOOL_MODULES: module 'acme_missing' cannot be imported: ModuleNotFoundError" in message


def test_agents_with_their_tools_known_start(usertools: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOL_MODULES", "acme_tools")
    monkeypatch.setenv("AGENTS_FILE", str(USERTOOLS.parent / "agents_usertools.toml"))
    get_settings.cache_clear()
    _load.cache_clear()
    agents = load_at_start()
    shop = agents["main"]
    assert shop.tool_names(tool_names(), subagent=False) == ("echo", "lookup_order", "refund_order", "check_inventory")
    assert (shop.model_options.model, shop.model_options.temperature, shop.model_options.max_tokens) == (
        "acme-large",
        0.2,
        256,
    )


@pytest.mark.parametrize("bad", ["héllo", "日本", "a" * 65, "has space", "dot.ted"])
def test_a_tool_name_outside_ascii_letters_digits_underscore_and_dash_is_refused_naming_it(bad: str) -> None:
    def fn() -> str:
        return "x"

    with pytest.raises(ToolDefinitionError) as info:
        tool(name=bad)(fn)
    assert repr(bad) in str(info.value) and bad not in REGISTRY


def test_a_tool_module_with_a_non_ascii_tool_name_stops_the_start_naming_the_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "acme_unicode_tools.py").write_text(
        "from harness.tools import tool\n\n@tool\ndef réserver(n: int) -> str:\n    return 'ok'\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TOOL_MODULES", "acme_unicode_tools")
    get_settings.cache_clear()
    _load.cache_clear()
    try:
        with pytest.raises(AgentConfigError) as info:
            load_at_start()
        assert "'réserver'" in str(info.value) and "acme_unicode_tools" in str(info.value)
    finally:
        sys.modules.pop("acme_unicode_tools", None)
        get_settings.cache_clear()
        _load.cache_clear()


def test_a_hung_tool_times_out_as_may_or_may_not_have_taken_effect_and_the_loop_goes_on(
    scratch: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    @tool(timeout_seconds=0.3)
    def hang() -> str:
        """Never answers."""
        time.sleep(5)
        return "late"

    @tool
    def hang_default() -> str:
        """Never answers either."""
        time.sleep(5)
        return "late"

    scratch.extend(["hang", "hang_default"])
    started = time.monotonic()
    assert run_inline("hang", "{}", ctx(), ("hang",)) == (
        "error: tool 'hang' timed out after 0.3 seconds; it may or may not have taken effect"
    )
    monkeypatch.setenv("TOOL_TIMEOUT_SECONDS", "0.5")
    get_settings.cache_clear()
    try:
        assert run_inline("hang_default", "{}", ctx(), ("hang_default",)).startswith(
            "error: tool 'hang_default' timed out after 0.5 seconds"
        )
    finally:
        get_settings.cache_clear()
    assert time.monotonic() - started < 3
    assert lookup("wait") is not None and (lookup("wait").timeout_seconds or 0) > 24 * 3600  # type: ignore[union-attr]


def test_a_long_result_is_cut_at_tool_result_max_chars_with_a_note_where(
    scratch: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    @tool
    def dump(n: int) -> str:
        """Dump n characters."""
        return "x" * n

    scratch.append("dump")
    monkeypatch.setenv("TOOL_RESULT_MAX_CHARS", "1000")
    get_settings.cache_clear()
    try:
        assert run_inline("dump", '{"n": 1000}', ctx(), ("dump",)) == "x" * 1000
        cut = run_inline("dump", '{"n": 5000}', ctx(), ("dump",))
    finally:
        get_settings.cache_clear()
    assert cut == "x" * 1000 + "\n[cut: the result was 5000 characters; the first 1000 are shown]"


def test_docstring_args_become_parameter_descriptions(scratch: list[str]) -> None:
    @tool
    def refund(order_id: int, amount_cents: Annotated[int, Field(description="from the hint")], note: str = "") -> str:
        """Refund part of an order.

        The payment service deduplicates on the order id.

        Args:
            order_id: The order to refund,
                as printed on the receipt.
            amount_cents: Ignored: the type hint's description wins.
            note: A note for the customer.
        """
        return "ok"

    scratch.append("refund")
    found = lookup("refund")
    assert found is not None
    props = found.parameters["properties"]
    assert props["order_id"]["description"] == "The order to refund, as printed on the receipt."
    assert props["amount_cents"]["description"] == "from the hint"
    assert props["note"]["description"] == "A note for the customer." and props["note"]["default"] == ""
    assert found.parameters["required"] == ["order_id", "amount_cents"]
    assert found.description == "Refund part of an order.\n\nThe payment service deduplicates on the order id."
