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

import binascii
import quopri
import re
from datetime import date, datetime
from email.utils import parsedate_to_datetime

from fieldrecovery.errors import EmlInvalid, EmlTooLarge
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
from settings import EmlLimitSettings

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
#: A Date header longer than this is ignored (no sent date), never parsed.
MAX_DATE_CHARS = 256
_REVISION = re.compile(r"[1-9][0-9]{0,9}", re.ASCII)
_LINE = re.compile(r"^\s*([A-Za-z][A-Za-z ]*?)\s*:\s*(.*?)\s*$")
_CONFIRMATION = re.compile(r"^[A-Z0-9][A-Z0-9-]{3,31}$")
_NUMERIC_DATE = re.compile(r"^(\d{1,2})[/.](\d{1,2})(?:[/.](\d{4}))?$")
_COUNT = re.compile(r"^[1-9][0-9]{0,2}$")
_AMOUNT = re.compile(r"^(0|[1-9][0-9]{0,11})(\.[0-9]{1,2})?$")
_CURRENCY = re.compile(r"^[A-Z]{3}$")
_CURRENCY_SYMBOLS = {"€": "EUR", "£": "GBP"}
#: A header line: a name of printable ASCII but ``:``, then ``:`` (RFC 5322 field-name).
_HEADER_NAME = re.compile(rb"[\x21-\x39\x3b-\x7e]+")
#: RFC 5322 msg-id once unfolded and stripped of its CFWS: ``<id-left@id-right>``, no space.
_MSG_ID = re.compile(r"\A<[^\s<>()@]+@[^\s<>()@]+>\Z")
#: One ``;name=value`` parameter of a Content-Type (value a token or a quoted string).
_PARAM = re.compile(rb';\s*([!#-\'*+\-.0-9A-Z^-~]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)', re.IGNORECASE)


def path_of(field: str) -> str:
    return f"booking.{field}"


def parse_eml(
    raw: bytes, channel: SourceKind = SourceKind.MANUAL_EML, limits: EmlLimitSettings | None = None
) -> ParsedFactSet:
    """Parse one EML into facts; raises EmlInvalid for anything this parser cannot take.

    EmlTooLarge (an EmlInvalid, code ``eml_too_large``) when the file passes one of ``limits``
    (input bytes, parts, nesting depth, header bytes; the defaults of EmlLimitSettings when
    None). A hostile file (an unknown charset, a NUL, an overlong or malformed Message-ID, a
    revision that is not ASCII digits or does not fit an ``integer``) is EmlInvalid before
    anything is hashed or written: never another exception, RecursionError included.

    The structure is read here, not by the ``email`` package: its header parser is quadratic
    in repeated RFC 2047 encoded words and Content-Type parameters, and its MIME parser recurses
    once per nesting level. This reader is one linear pass over the bytes, without recursion,
    and decodes only the text part it returns; no header is RFC 2047-decoded.
    """
    bounds = limits or EmlLimitSettings()
    if len(raw) > bounds.max_input_bytes:
        raise EmlTooLarge(f"the EML is larger than {bounds.max_input_bytes} bytes")
    try:
        return _parse(raw, channel, bounds)
    except EmlInvalid:
        raise
    except (
        LookupError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        UnicodeError,
        RecursionError,
    ) as exc:
        # NOTE: a codec or the date parser may raise many kinds on hostile input (LookupError
        # for an unknown charset); all mean "not an EML we read".
        raise EmlInvalid(f"the EML cannot be parsed ({type(exc).__name__})") from None


def _parse(raw: bytes, channel: SourceKind, limits: EmlLimitSettings) -> ParsedFactSet:
    headers, body_start = _headers(raw, 0, len(raw), limits.max_header_bytes)
    message_id = _message_id(headers.get(b"message-id"))
    revision = _revision(headers.get(b"x-booking-revision"))
    sent = _sent_date(headers.get(b"date"))
    body = _text_part(raw, headers, body_start, limits)
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


# --- the structure: header sections and MIME parts, one pass, no recursion -----------------


def _headers(raw: bytes, start: int, end: int, limit: int) -> tuple[dict[bytes, bytes], int]:
    """The first value of each header of the entity at ``raw[start:end]``, unfolded, and where
    its body starts. Names are lower-cased; a value keeps the white space of its folds (RFC 5322
    unfolding removes only the line breaks). A section longer than ``limit`` bytes is EmlTooLarge.
    """
    found: dict[bytes, list[bytes]] = {}
    current: list[bytes] | None = None
    pos = start
    if start == 0 and raw.startswith(b"From "):  # an mbox "From " line before the headers
        nl = raw.find(b"\n", 0, end)
        pos = end if nl < 0 else nl + 1
    while pos < end:
        nl = raw.find(b"\n", pos, min(end, start + limit + 1))
        line_end = end if nl < 0 else nl + 1
        if nl < 0 and end - start > limit:
            raise EmlTooLarge(f"a header section is longer than {limit} bytes")
        line = raw[pos:line_end].rstrip(b"\r\n")
        if not line:
            return _first_values(found), line_end
        if line[:1] in (b" ", b"\t"):
            if current is not None:
                current.append(line)
        else:
            name, colon, value = line.partition(b":")
            if not colon or not _HEADER_NAME.fullmatch(name.rstrip()):
                return _first_values(found), pos  # not a header: the body starts here
            key = name.rstrip().lower()
            current = [value] if key not in found else None  # only the first of each is read
            if current is not None:
                found[key] = current
        pos = line_end
        if pos - start > limit:
            raise EmlTooLarge(f"a header section is longer than {limit} bytes")
    return _first_values(found), end


def _first_values(found: dict[bytes, list[bytes]]) -> dict[bytes, bytes]:
    return {name: b"".join(parts) for name, parts in found.items()}


def _content_type(headers: dict[bytes, bytes]) -> tuple[str, dict[bytes, bytes]]:
    """(``type/subtype`` lower-cased, parameters); ``text/plain`` when absent or malformed."""
    value = headers.get(b"content-type", b"")
    kind, _, rest = value.partition(b";")
    ctype = kind.strip().lower().decode("latin-1")
    if ctype.count("/") != 1:
        ctype = "text/plain"
    params: dict[bytes, bytes] = {}
    for match in _PARAM.finditer(b";" + rest):
        name, text = match.group(1).lower(), match.group(2)
        if text.startswith(b'"'):
            text = re.sub(rb"\\(.)", rb"\1", text[1:-1])
        params.setdefault(name, text)
    return ctype, params


def _is_attachment(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-disposition", b"").partition(b";")[0].strip().lower() == b"attachment"


def _text_part(raw: bytes, headers: dict[bytes, bytes], body_start: int, limits: EmlLimitSettings) -> str:
    """The content of the first ``text/plain`` part that is not an attachment, depth first.

    multipart/related offers its root (first) part only; other multiparts every part in order;
    other types are skipped. Counting parts and depth bounds the walk (EmlTooLarge past them).
    """
    # (headers, body start, end, depth); a stack, so the nesting depth costs no recursion.
    stack = [(headers, body_start, len(raw), 0)]
    parts = 0
    while stack:
        entity, start, end, depth = stack.pop()
        if _is_attachment(entity):
            continue
        ctype, params = _content_type(entity)
        if ctype == "text/plain":
            return _decoded(raw[start:end], entity, params)
        if not ctype.startswith("multipart/"):
            continue
        boundary = params.get(b"boundary")
        if not boundary:
            continue
        if depth + 1 > limits.max_depth:
            raise EmlTooLarge(f"the EML nests multiparts deeper than {limits.max_depth}")
        children = _split(raw, start, end, boundary, limits.max_parts - parts)
        parts += len(children)
        if ctype == "multipart/related":
            children = children[:1]
        for child_start, child_end in reversed(children):
            child_headers, child_body = _headers(raw, child_start, child_end, limits.max_header_bytes)
            stack.append((child_headers, child_body, child_end, depth + 1))
    raise EmlInvalid("the EML has no text/plain part")


def _split(raw: bytes, start: int, end: int, boundary: bytes, allowed: int) -> list[tuple[int, int]]:
    """The (start, end) of each part of the multipart body ``raw[start:end]``.

    A delimiter is a line ``--boundary`` (``--boundary--`` closes), white space allowed after it;
    the line break before it belongs to it. The preamble and the epilogue are not parts; without
    a closing delimiter the last part runs to the end. More than ``allowed`` parts: EmlTooLarge.
    """
    marker = b"--" + boundary
    bounds: list[tuple[int, int]] = []
    part_start: int | None = None
    pos = start
    while True:
        hit = raw.find(marker, pos, end)
        if hit < 0:
            break
        pos = hit + 1
        if hit != start and raw[hit - 1 : hit] != b"\n":
            continue
        nl = raw.find(b"\n", hit, end)
        line_end = end if nl < 0 else nl + 1
        rest = raw[hit + len(marker) : line_end].rstrip(b"\r\n")
        closing = rest.startswith(b"--")
        if (rest[2:] if closing else rest).strip(b" \t"):
            continue  # a longer boundary or text that starts like one
        if part_start is not None:
            cut = hit - 1 if hit > start else hit
            if cut > part_start and raw[cut - 1 : cut] == b"\r":
                cut -= 1
            bounds.append((part_start, max(cut, part_start)))
            if len(bounds) > allowed:
                raise EmlTooLarge("the EML has more MIME parts than allowed")
        if closing:
            return bounds
        part_start = line_end
        pos = line_end
    if part_start is not None and part_start < end:
        bounds.append((part_start, end))
        if len(bounds) > allowed:
            raise EmlTooLarge("the EML has more MIME parts than allowed")
    return bounds


def _decoded(payload: bytes, headers: dict[bytes, bytes], params: dict[bytes, bytes]) -> str:
    """The text of a part: its transfer encoding undone, then its charset (ASCII by default)."""
    encoding = headers.get(b"content-transfer-encoding", b"").strip().lower()
    if encoding == b"base64":
        data = b"".join(payload.split())
        try:
            payload = binascii.a2b_base64(data + b"=" * (-len(data) % 4))
        except binascii.Error:
            pass  # the email package keeps an undecodable payload as it is, and so do we
    elif encoding == b"quoted-printable":
        payload = quopri.decodestring(payload)
    charset = params.get(b"charset", b"us-ascii").decode("ascii").strip() or "us-ascii"
    return payload.decode(charset, "replace")


# --- the headers the parser needs ----------------------------------------------------------


def _message_id(value: bytes | None) -> str:
    """The msg-id, unfolded and without its surrounding comments (RFC 5322); anything else,
    a space inside the id included, is EmlInvalid: never a cut id."""
    if value is None:
        raise EmlInvalid("the EML has no Message-ID header")
    if len(value) > 4 * MAX_MESSAGE_ID_CHARS:
        raise EmlInvalid(f"the Message-ID must be printable text of at most {MAX_MESSAGE_ID_CHARS} characters")
    text = _without_comments(value.decode("utf-8")).strip(" \t\r\n")
    if not text:
        raise EmlInvalid("the EML has no Message-ID header")
    if len(text) > MAX_MESSAGE_ID_CHARS or not storable_text(text) or not text.isprintable():
        raise EmlInvalid(f"the Message-ID must be printable text of at most {MAX_MESSAGE_ID_CHARS} characters")
    if not _MSG_ID.match(text):
        raise EmlInvalid("the Message-ID is not one <id@domain> (RFC 5322 msg-id)")
    return text


def _without_comments(text: str) -> str:
    """``text`` without its RFC 5322 comments (nested, with quoted pairs): one loop, no
    recursion, so a thousand ``(`` cost a thousand steps. Unbalanced: EmlInvalid."""
    out: list[str] = []
    depth = 0
    escaped = False
    for char in text:
        if depth:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == "(":
                depth += 1
            elif char == ")":
                depth -= 1
                if not depth:
                    out.append(" ")
        elif char == "(":
            depth = 1
        else:
            out.append(char)
    if depth:
        raise EmlInvalid("the Message-ID has an unclosed comment")
    return "".join(out)


def _revision(value: bytes | None) -> int:
    text = (value or b"1").decode("ascii", "replace").strip(" \t\r\n")
    # NOTE: str.isdigit() accepts "²" (int() does not) and any number of digits.
    if not _REVISION.fullmatch(text) or int(text) > INT32_MAX:
        raise EmlInvalid(f"X-Booking-Revision must be an integer from 1 to {INT32_MAX}")
    return int(text)


def _sent_date(value: bytes | None) -> tuple[date, str] | None:
    if value is None or len(value) > MAX_DATE_CHARS:
        return None
    text = " ".join(value.decode("ascii", "replace").split())
    try:
        sent: datetime = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return sent.date(), f"Date: {text}"


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
