"""The round journal as the loops use it (docs/state-machines.md, "Journal entry"; J1 and J2).

One round, in the order its commits happen:

1. the model answers with tool calls -> ``journal_reply`` gives every call its local id
   (harness.callids: a provider id repeated in the reply is refused) and commits the reply
   (fenced by the loop's epoch; a relaxed commit, see ``models.journal.relaxed_commit``)
   before the first tool runs;      crash point journal.after_reply
2. a tool that is not safe to repeat has its start committed (``STARTED``, starts + 1) before
   it runs;                                                   crash point journal.after_tool_start
3. each tool's result is committed as it completes, except the last one of a repeatable tool,
   which the round's own transaction carries;                crash point journal.after_tool_result
4. ``commit_round`` lands assistant + every TOOL in ONE transaction and closes the entry.

A delegating reply has no entry of its own: its pending round, committed in the transaction
that creates its children before any of its tools runs, is its journal (harness.parent; crash
point journal.after_reply right after that commit). It is journaled here only when none of its
delegations creates a child and it becomes an ordinary round. An open entry of a delegating
reply written by an earlier release is still continued: its children are created once and the
creation closes it.

A loop that starts (a recovered one, or the next run after a crash) calls ``resume`` before
asking the model: an open entry asked from the same history is continued without a model call;
results journaled are used as they are; an interrupted tool that is read-only or idempotent
runs again (same ``idempotency_key``: the key is per call, and the call's local id is read
back from the journal: harness.callids); an interrupted tool
that is neither is NOT run again: its TOOL result says so, with its arguments, and the model
decides; a tool that never started runs normally. An entry asked from an older history is
abandoned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from crashpoints import crash_point
from harness.callids import call_of, context_for, localize
from harness.fence import Fence
from harness.model import ModelReply, ToolCall
from harness.rounds import ToolResult, write_round
from harness.tools import lookup, run_inline
from harness.usage import record_call
from logfmt import log_event
from models import CallStatus, LeaseLost, transaction
from models import journal as store
from settings import get_settings

if TYPE_CHECKING:
    from harness.approval import Gate
    from models.approval import Requested

log = logging.getLogger(__name__)

#: Longest argument text quoted back to the model in an interrupted call's result.
MAX_QUOTED_ARGUMENT_CHARS = 2000


def repeatable(name: str) -> bool:
    """True when the tool is declared read-only or idempotent (``@tool(read_only=True)``,
    ``@tool(idempotent=True)``, or an MCP server's ``readOnlyHint`` / ``idempotentHint``): safe
    to run again after a crash interrupted it. The ONE place that asks."""
    found = lookup(name)
    return found is not None and (found.read_only or found.idempotent)


def interrupted_result(call: ToolCall) -> str:
    """The TOOL result of a call that a restart interrupted and that is not safe to repeat."""
    arguments = (
        call.arguments
        if len(call.arguments) <= MAX_QUOTED_ARGUMENT_CHARS
        else call.arguments[:MAX_QUOTED_ARGUMENT_CHARS] + "…"
    )
    return (
        f"error: the call to {call.name!r} was interrupted by a restart and may or may not have taken "
        f"effect; it was not run again. Its arguments were: {arguments}"
    )


def not_started_result(call: ToolCall) -> str:
    """The TOOL result of a delegating round's inline call whose start was never committed: its
    parent's run stopped before it (a crash, or a take-over after a stall), and no later run of
    it can start it (its start is fenced), so it did not take effect."""
    return (
        f"error: the call to {call.name!r} was not run: the run that was to start it stopped before it "
        "started, so it did not take effect. Call it again if it is still needed."
    )


@dataclass(frozen=True)
class RoundInFlight:
    """A journaled round: the reply and what its tools left in the journal."""

    #: The round_journal entry; None for a delegating reply, whose entry is the pending round
    #: committed with its children (``harness.parent``): nothing runs before that commit.
    journal_id: int | None
    reply: ModelReply
    #: tool_call_id -> TOOL error written instead of running the call.
    refused: dict[str, str] = field(default_factory=dict)
    #: tool_call_id -> journaled result.
    results: dict[str, str] = field(default_factory=dict)
    #: Calls started without a journaled result.
    started: frozenset[str] = frozenset()
    #: True when a recovered loop continues the round (the model was not asked again).
    replayed: bool = False
    #: tool_call_id -> the arguments an approver edited the call to, journaled while this loop
    #: ran the round (a resumed round reads them back in its reply): the round lands with them.
    edited: dict[str, str] = field(default_factory=dict)

    def calls(self) -> list[ToolCall]:
        """The round's calls as they run and land in the history: an edited call with the
        arguments its approver gave."""
        return [replace(c, arguments=self.edited[c.id]) if c.id in self.edited else c for c in self.reply.tool_calls]


def resume(fence: Fence, session_id: int) -> RoundInFlight | None:
    """The open round of the session, handed to this loop's epoch; None when there is none
    (one read, nothing written) or when it was asked from an older history (abandoned)."""
    with transaction() as s:
        if store.open_entry(s, session_id) is None:
            return None
        fence.check(s)
        rnd = resume_in(s, session_id, fence.epoch)
    return rnd


def resume_in(s: Session, session_id: int, epoch: int) -> RoundInFlight | None:
    """``resume`` in the caller's transaction, which holds ``epoch`` (it took the session or
    checked its fence)."""
    entry = store.open_entry(s, session_id)
    if entry is None:
        return None
    if entry.after_message_id != store.last_live_message_id(s, session_id):
        store.abandon(s, entry.id)
        log_event(log, "round_journal_abandoned", session_id=session_id, journal_id=entry.id)
        return None
    if not store.adopt(s, entry.id, epoch=epoch):
        # NOTE: the caller holds the epoch in this transaction, so a newer loop cannot hold it.
        raise LeaseLost(f"round journal {entry.id} is held by a newer epoch")
    calls = store.calls_of(s, entry.id)
    reply = ModelReply(
        entry.content,
        tuple(call_of(c) for c in entry.tool_calls),
        entry.prompt_tokens,
        entry.completion_tokens,
        provider_fields=dict(entry.provider_fields or {}),
    )
    rnd = RoundInFlight(
        entry.id,
        reply,
        dict(entry.refused),
        {c.tool_call_id: c.result or "" for c in calls if c.status == CallStatus.FINISHED},
        frozenset(c.tool_call_id for c in calls if c.status == CallStatus.STARTED),
        replayed=True,
    )
    log_event(
        log,
        "round_journal_resumed",
        session_id=session_id,
        journal_id=rnd.journal_id,
        results=len(rnd.results),
        interrupted=len(rnd.started),
    )
    return rnd


Prepare = Callable[[Session, ModelReply], tuple[ModelReply, dict[str, str]]]


def journal_reply(
    fence: Fence, session_id: int, reply: ModelReply, prepare: Prepare | None = None, *, approval: Gate | None = None
) -> RoundInFlight:
    """Commit the reply as the session's open round before any of its tools runs, every call
    under its local id (a call that has one keeps it; a provider id repeated in the reply is
    refused: harness.callids). ``prepare`` runs in the same transaction and may refuse more
    calls; what it decided is journaled with the reply. ``approval``: the calls that need a
    human decision get their requests in the same transaction (harness.approval), keyed by
    their local ids."""
    reply, refused = localize(reply, session_id=session_id)
    requested: list[Requested] = []
    with transaction() as s:
        store.relaxed_commit(s)
        fence.check(s)
        if prepare is not None:
            reply, more = prepare(s, reply)
            refused = {**refused, **more}
        # The tools' approval callables decide here, and their decisions commit with the reply.
        rules = approval.rules(reply, refused, session_id=session_id) if approval is not None else {}
        journal_id = store.write_reply(
            s,
            session_id=session_id,
            epoch=fence.epoch,
            content=reply.content,
            tool_calls=[c.to_openai() for c in reply.tool_calls],
            refused=refused,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
            provider_fields=reply.provider_fields,
            approval_rules=rules,
        )
        record_call(s, session_id, reply, execution_id=getattr(fence, "execution_id", None))
        if approval is not None:
            requested = approval.record(
                s, session_id=session_id, journal_id=journal_id, reply=reply, refused=refused, rules=rules
            )
    crash_point("journal.after_reply")
    if requested:
        crash_point("approval.after_request")
        from harness.approval_notify import announce

        announce(requested)
    return RoundInFlight(journal_id, reply, refused)


def run_tools(
    fence: Fence,
    session_id: int,
    rnd: RoundInFlight,
    *,
    allowed: tuple[str, ...],
    deadline: datetime | None,
    kind: str,
    approval: Gate | None = None,
) -> dict[str, str]:
    """Run (or take from the journal) every call of the round; returns tool_call_id -> TOOL
    content. Each result but the last one of a repeatable tool is journaled as it completes;
    the caller's round transaction carries that one.

    ``approval``: the calls with an approval request run after every other call, each as its
    request answers (harness.approval); every result of such a round is journaled, and
    ``AwaitingApproval`` is raised when a request is still pending at the end."""
    entry = _entry_of(rnd)
    out: dict[str, str] = {}
    todo: tuple[ToolCall, ...] | list[ToolCall] = rnd.reply.tool_calls
    gated: set[str] = set()
    waiting: list[str] = []
    if approval is not None:
        from harness.approval import order

        runnable = [
            c
            for c in rnd.reply.tool_calls
            if c.id not in rnd.refused
            and c.id not in rnd.results
            and not (c.id in rnd.started and not repeatable(c.name))  # reported interrupted, never run
        ]
        gated = approval.gated(
            fence, session_id=session_id, journal_id=rnd.journal_id, runnable=runnable, replayed=rnd.replayed
        )
        todo = order(rnd.reply.tool_calls, gated)
    for n, call in enumerate(todo):
        if call.id in rnd.refused:
            out[call.id] = rnd.refused[call.id]
            continue
        if call.id in rnd.results:
            out[call.id] = rnd.results[call.id]
            continue
        arguments = call.arguments
        note: Callable[[str], str] = _as_is
        if gated and _approval_key(call) in gated:
            from harness.approval import verdict

            answer = verdict(fence, session_id, call)
            if answer.waits:
                waiting.append(call.id)
                continue
            if answer.result is not None:
                out[call.id] = answer.result
                _journal_result(fence, entry, call, answer.result, repeatable(call.name))
                continue
            arguments = answer.arguments or call.arguments
            if answer.edited_by is not None:
                call, note = _approved_call(fence, rnd, call, arguments, answer.edited_by), _edited(answer.edited_by)
        safe = repeatable(call.name)
        if call.id in rnd.started and not safe:
            log_event(log, "tool_interrupted_not_rerun", session_id=session_id, tool=call.name)
            out[call.id] = note(interrupted_result(call))
            continue
        if safe and rnd.replayed and not _may_run_again(fence, entry, call):
            log_event(log, "tool_interrupted_not_rerun", session_id=session_id, tool=call.name, reason="max_reruns")
            out[call.id] = note(interrupted_result(call))
            continue
        if not safe:
            with transaction() as s:
                fence.check(s)
                store.mark_started(s, entry, call.id, tool_name=call.name, repeatable=False)
            crash_point("journal.after_tool_start")
        ctx = context_for(session_id, call, deadline, fence.should_stop, kind)
        result = note(run_inline(call.name, arguments, ctx, allowed))
        out[call.id] = result
        if n == len(todo) - 1 and safe and not gated:
            continue  # the round's transaction carries it; a crash before it runs the tool again
        _journal_result(fence, entry, call, result, safe)
    if waiting:
        from harness.approval import AwaitingApproval

        raise AwaitingApproval(entry, waiting)
    return out


def _as_is(result: str) -> str:
    return result


def _edited(by: str) -> Callable[[str], str]:
    from harness.approval import edited_result

    return lambda result: edited_result(by, result)


def _approved_call(fence: Fence, rnd: RoundInFlight, call: ToolCall, arguments: str, by: str) -> ToolCall:
    """The call an approver edited, as it runs, is keyed, is journaled and lands in the history:
    its arguments are the approver's. They are journaled before the tool starts (a crash after
    that quotes them, never the model's unapproved ones); a resumed round has them already."""
    if call.arguments != arguments:
        with transaction() as s:
            fence.check(s)
            store.edit_call(s, _entry_of(rnd), call.id, arguments)
        crash_point("approval.after_edited_call")
        log_event(log, "approval_edited_call", session_id=fence.session_id, call_id=call.id, by=by)
    rnd.edited[call.id] = arguments
    return replace(call, arguments=arguments)


def _approval_key(call: ToolCall) -> str:
    from harness.approval import call_id_of

    return call_id_of(call)


def _journal_result(fence: Fence, entry: int, call: ToolCall, result: str, safe: bool) -> None:
    with transaction() as s:
        store.relaxed_commit(s)
        fence.check(s)
        store.mark_finished(s, entry, call.id, result, tool_name=call.name, repeatable=safe)
    crash_point("journal.after_tool_result")


def _may_run_again(fence: Fence, entry: int, call: ToolCall) -> bool:
    """Count one more run of a repeatable call in a round a recovered loop continues; False when
    that would pass TOOL_MAX_RERUNS. A repeatable call journals no start on the first run (no
    extra commit on the normal path), so the count is of re-runs: a call that kills its worker
    every time (a poison round) is run at most 1 + TOOL_MAX_RERUNS times, then reported
    interrupted."""
    with transaction() as s:
        fence.check(s)
        reruns = store.mark_started(s, entry, call.id, tool_name=call.name, repeatable=True)
    return reruns <= get_settings().TOOL_MAX_RERUNS


def commit_round(fence: Fence, session_id: int, rnd: RoundInFlight, results: dict[str, str]) -> None:
    """Land assistant + every TOOL in ONE transaction, and close the journal entry in it."""
    reply = rnd.reply
    with transaction() as s:
        fence.check(s, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)
        write_round(
            s,
            session_id,
            reply.content,
            [c.to_openai() for c in rnd.calls()],
            [ToolResult(c.id, results[c.id]) for c in reply.tool_calls],
            provider_fields=reply.provider_fields,
        )
        store.close(s, _entry_of(rnd))


def _entry_of(rnd: RoundInFlight) -> int:
    """The round's journal entry: a round runs tools outside a pending round only once its
    reply is journaled."""
    if rnd.journal_id is None:
        raise RuntimeError("a round's tools run only after its reply was journaled")
    return rnd.journal_id


def close_in(s: Session, rnd: RoundInFlight) -> None:
    """Close the entry in the caller's transaction (a delegating round's creation)."""
    if rnd.journal_id is not None:
        store.close(s, rnd.journal_id)
