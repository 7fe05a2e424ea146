"""Deterministic parser for the fixed-channel booking-confirmation EML format.

The format (one channel, documented here because the parser is its only definition):

* headers: ``Message-ID`` (required: the source message id), ``Date`` (the sent date; it
  supplies the year of dates written without one), optional ``X-Booking-Revision: N`` (default 1);
* the first ``text/plain`` part that is not an attachment holds ``Label: value`` lines, one
  per field, labels case-insensitive::

      Confirmation Number: FC-20260305-0042
      Guest Name: Jane Doe
      Arrival Date: 2026-03-05        (also 05/03, 05/03/2026, 05.03.2026)
      Departure Date: 2026-03-07
      Room Type: Deluxe King          (one of ROOM_CATALOGUE)
      Room Count: 1
      Adults: 2
      Rate Amount: 180.00
      Currency: EUR                   (ISO 4217; € and £ are read as EUR and GBP)

Verdicts: a valid value is RESOLVED. A value the parser cannot settle but has evidence and
candidates for (a day/month-ambiguous date such as ``05/03``, a room type outside the
catalogue) is UNRESOLVED + RECOVERABLE with its evidence line and candidates. A missing label,
a repeated label with different values, or a value with no candidate is UNRESOLVED +
NOT_RECOVERABLE. Other lines, other parts and attachments are ignored.
"""

from __future__ import annotations

import email
import email.policy
import re
from datetime import date, datetime
from email.message import EmailMessage
from email.utils import parsedate_to_datetime

from fieldrecovery.errors import EmlInvalid
from fieldrecovery.schemas import (
    INT32_MAX,
    Candidate,
    Evidence,
    FactStatus,
    ParsedFact,
    ParsedFactSet,
    Recoverability,
    SourceKind,
    SourceRef,
    ValueSchema,
    ValueType,
    storable_text,
)

#: Room types the hotel sells, in catalogue order.
ROOM_CATALOGUE = ("Standard Double", "Superior Twin", "Deluxe King", "Junior Suite", "Family Room")

#: field -> (label, value type), in document order.
FIELDS: dict[str, tuple[str, ValueType]] = {
    "confirmation_number": ("confirmation number", ValueType.STRING),
    "guest_name": ("guest name", ValueType.STRING),
    "arrival_date": ("arrival date", ValueType.DATE),
    "departure_date": ("departure date", ValueType.DATE),
    "room_type": ("room type", ValueType.ENUM),
    "room_count": ("room count", ValueType.INTEGER),
    "adults": ("adults", ValueType.INTEGER),
    "rate_amount": ("rate amount", ValueType.DECIMAL),
    "currency": ("currency", ValueType.STRING),
}
_LABEL_TO_FIELD = {label: field for field, (label, _) in FIELDS.items()}
#: A recovered departure date must be read the same way as the arrival date.
DEPENDS_ON = {"departure_date": ["arrival_date"]}

#: Evidence ref of the Date header (the sent date).
SENT_DATE_REF = "H:date"

#: The width of ``source_message_id`` (fieldrecovery/tables.py).
MAX_MESSAGE_ID_CHARS = 512
_REVISION = re.compile(r"[1-9][0-9]{0,9}", re.ASCII)
_LINE = re.compile(r"^\s*([A-Za-z][A-Za-z ]*?)\s*:\s*(.*?)\s*$")
_CONFIRMATION = re.compile(r"^[A-Z0-9][A-Z0-9-]{3,31}$")
_NUMERIC_DATE = re.compile(r"^(\d{1,2})[/.](\d{1,2})(?:[/.](\d{4}))?$")
_COUNT = re.compile(r"^[1-9][0-9]{0,2}$")
_AMOUNT = re.compile(r"^(0|[1-9][0-9]{0,11})(\.[0-9]{1,2})?$")
_CURRENCY = re.compile(r"^[A-Z]{3}$")
_CURRENCY_SYMBOLS = {"€": "EUR", "£": "GBP"}


def path_of(field: str) -> str:
    return f"booking.{field}"


def parse_eml(raw: bytes, channel: SourceKind = SourceKind.MANUAL_EML) -> ParsedFactSet:
    """Parse one EML into facts; raises EmlInvalid for anything this parser cannot take.

    A hostile file (an unknown charset, a header the email package chokes on, a NUL or an
    overlong Message-ID, a revision that is not ASCII digits or does not fit an ``integer``)
    is EmlInvalid before anything is hashed or written: never another exception.
    """
    try:
        return _parse(raw, channel)
    except EmlInvalid:
        raise
    except (LookupError, ValueError, TypeError, AttributeError, IndexError, KeyError, UnicodeError) as exc:
        # NOTE: the email package raises many kinds on hostile input (LookupError for an unknown
        # charset, ValueError or IndexError from header parsers); all mean "not an EML we read".
        raise EmlInvalid(f"the EML cannot be parsed ({type(exc).__name__})") from None


def _parse(raw: bytes, channel: SourceKind) -> ParsedFactSet:
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(msg, EmailMessage)
    message_id = str(msg.get("Message-ID", "")).strip()
    if not message_id:
        raise EmlInvalid("the EML has no Message-ID header")
    if len(message_id) > MAX_MESSAGE_ID_CHARS or not storable_text(message_id) or not message_id.isprintable():
        raise EmlInvalid(f"the Message-ID must be printable text of at most {MAX_MESSAGE_ID_CHARS} characters")
    revision = _revision(msg)
    sent = _sent_date(msg)
    body = _text_part(msg)
    lines: dict[str, list[tuple[int, str, str]]] = {}
    for number, line in enumerate(body.splitlines(), start=1):
        match = _LINE.match(line)
        if match is None:
            continue
        field = _LABEL_TO_FIELD.get(" ".join(match.group(1).lower().split()))
        if field is not None:
            lines.setdefault(field, []).append((number, line.strip(), match.group(2)))
    facts = [_fact(field, vtype, lines.get(field, []), sent) for field, (_, vtype) in FIELDS.items()]
    facts = _link_dependencies(facts)
    return ParsedFactSet(source=SourceRef(message_id=message_id, revision=revision, channel=channel), facts=facts)


def _revision(msg: EmailMessage) -> int:
    value = str(msg.get("X-Booking-Revision", "1")).strip()
    # NOTE: str.isdigit() accepts "²" (int() does not) and any number of digits.
    if not _REVISION.fullmatch(value) or int(value) > INT32_MAX:
        raise EmlInvalid(f"X-Booking-Revision must be an integer from 1 to {INT32_MAX}")
    return int(value)


def _sent_date(msg: EmailMessage) -> tuple[date, str] | None:
    header = msg.get("Date")
    if header is None:
        return None
    try:
        sent: datetime = parsedate_to_datetime(str(header))
    except (TypeError, ValueError):
        return None
    return sent.date(), f"Date: {str(header).strip()}"


def _text_part(msg: EmailMessage) -> str:
    part = msg.get_body(preferencelist=("plain",))
    if part is None or part.is_attachment():
        raise EmlInvalid("the EML has no text/plain part")
    content = part.get_content()
    if not isinstance(content, str):
        raise EmlInvalid("the text part is not text")
    return content


def _fact(field: str, vtype: ValueType, found: list[tuple[int, str, str]], sent: tuple[date, str] | None) -> ParsedFact:
    schema = ValueSchema(type=vtype, values=list(ROOM_CATALOGUE) if vtype == ValueType.ENUM else None)

    def unresolved(evidence: list[Evidence], candidates: list[str] | None = None) -> ParsedFact:
        return ParsedFact(
            field=field,
            path=path_of(field),
            value_schema=schema,
            status=FactStatus.UNRESOLVED,
            recoverability=Recoverability.RECOVERABLE if candidates else Recoverability.NOT_RECOVERABLE,
            evidence=evidence,
            candidates=[Candidate(ref=f"C{i}", value=v) for i, v in enumerate(candidates or [], start=1)],
        )

    if not found:
        return unresolved([])
    evidence = [Evidence(ref=f"L{number}", text=text) for number, text, _ in found]
    if len({raw for _, _, raw in found}) > 1:  # the mail contradicts itself: nothing to choose by
        return unresolved(evidence)
    settled, candidates = _read(field, found[0][2], sent)
    if settled is not None:
        return ParsedFact(
            field=field,
            path=path_of(field),
            value_schema=schema,
            status=FactStatus.RESOLVED,
            value=settled,
            evidence=evidence,
        )
    if candidates and vtype == ValueType.DATE and sent is not None:
        evidence.append(Evidence(ref=SENT_DATE_REF, text=sent[1]))
    return unresolved(evidence, candidates)


def _read(field: str, raw: str, sent: tuple[date, str] | None) -> tuple[str | None, list[str]]:
    """(settled value, None) or (None, candidates); no candidates means not recoverable."""
    vtype = FIELDS[field][1]
    if field == "confirmation_number":
        return (raw, []) if _CONFIRMATION.match(raw) else (None, [])
    if field == "guest_name":
        text = " ".join(raw.split())
        return (text, []) if 0 < len(text) <= 256 else (None, [])
    if vtype == ValueType.DATE:
        return _read_date(raw, sent)
    if field == "room_type":
        wanted = " ".join(raw.lower().split())
        for room in ROOM_CATALOGUE:
            if room.lower() == wanted:
                return room, []
        return None, list(ROOM_CATALOGUE)
    if vtype == ValueType.INTEGER:
        return (raw, []) if _COUNT.match(raw) else (None, [])
    if field == "rate_amount":
        return (raw, []) if _AMOUNT.match(raw) else (None, [])
    if field == "currency":
        code = _CURRENCY_SYMBOLS.get(raw, raw)
        return (code, []) if _CURRENCY.match(code) else (None, [])
    raise AssertionError(field)


def _read_date(raw: str, sent: tuple[date, str] | None) -> tuple[str | None, list[str]]:
    try:
        return date.fromisoformat(raw).isoformat(), []
    except ValueError:
        pass
    match = _NUMERIC_DATE.match(raw)
    if match is None:
        return None, []
    a, b = int(match.group(1)), int(match.group(2))
    if match.group(3):
        year = int(match.group(3))
    elif sent is not None:
        year = sent[0].year
    else:
        return None, []
    readings: list[str] = []
    for day, month in ((a, b), (b, a)):  # day-first, then month-first
        try:
            value = date(year, month, day).isoformat()
        except ValueError:
            continue
        if value not in readings:
            readings.append(value)
    if len(readings) == 1:
        return readings[0], []
    return None, readings


def _link_dependencies(facts: list[ParsedFact]) -> list[ParsedFact]:
    """A recoverable fact depends on the facts in DEPENDS_ON that are recoverable too."""
    by_field = {f.field: f for f in facts}
    linked = []
    for fact in facts:
        deps = [
            d
            for d in DEPENDS_ON.get(fact.field, [])
            if fact.recoverability == Recoverability.RECOVERABLE
            and by_field[d].recoverability == Recoverability.RECOVERABLE
        ]
        linked.append(fact.model_copy(update={"depends_on": deps}) if deps else fact)
    return linked
