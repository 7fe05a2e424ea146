"""The deterministic EML parser."""

from __future__ import annotations

import pytest

from fieldrecovery.eml import ROOM_CATALOGUE, parse_eml
from fieldrecovery.errors import EmlInvalid
from fieldrecovery.schemas import FactStatus, Recoverability, SourceKind
from tests.field_helpers import sample_eml


def _eml(body: str, headers: str = "Message-ID: <m1@x.example>\nDate: Fri, 20 Feb 2026 09:15:00 +0000\n") -> bytes:
    return (headers + "Content-Type: text/plain; charset=utf-8\n\n" + body).encode()


def _facts(raw: bytes) -> dict[str, object]:
    return {f.field: f for f in parse_eml(raw).facts}


def test_clean_sample_resolves_every_field_with_canonical_values() -> None:
    facts = parse_eml(sample_eml("clean"))
    assert all(f.status == FactStatus.RESOLVED for f in facts.facts)
    values = {f.field: f.value for f in facts.facts}
    assert values == {
        "confirmation_number": "FC-20260410-0007",
        "guest_name": "Li Wei",
        "arrival_date": "2026-04-10",
        "departure_date": "2026-04-12",
        "room_type": "Superior Twin",
        "room_count": "2",
        "adults": "3",
        "rate_amount": "95.50",
        "currency": "EUR",  # written as the € symbol
    }
    assert facts.source.message_id == "<fc-20260410-0007@fixed-channel.example>"
    assert facts.source.revision == 1
    assert facts.source.channel == SourceKind.MANUAL_EML


def test_day_month_ambiguous_date_is_recoverable_with_both_readings_and_its_evidence_line() -> None:
    facts = _facts(sample_eml("ambiguous"))
    arrival = facts["arrival_date"]
    assert arrival.status == FactStatus.UNRESOLVED
    assert arrival.recoverability == Recoverability.RECOVERABLE
    assert [c.value for c in arrival.candidates] == ["2026-03-05", "2026-05-03"]
    assert [e.text for e in arrival.evidence] == ["Arrival Date: 05/03", "Date: Fri, 20 Feb 2026 09:15:00 +0000"]
    # The departure must be read the same way as the arrival.
    assert facts["departure_date"].depends_on == ["arrival_date"]


def test_room_type_outside_the_catalogue_is_recoverable_with_the_catalogue_as_candidates() -> None:
    room = _facts(sample_eml("ambiguous"))["room_type"]
    assert room.recoverability == Recoverability.RECOVERABLE
    assert tuple(c.value for c in room.candidates) == ROOM_CATALOGUE
    assert room.evidence[0].text == "Room Type: Deluxe King Room (non-smoking)"


def test_missing_label_is_unresolved_and_not_recoverable() -> None:
    currency = _facts(sample_eml("multipart"))["currency"]
    assert currency.status == FactStatus.UNRESOLVED
    assert currency.recoverability == Recoverability.NOT_RECOVERABLE
    assert currency.evidence == [] and currency.candidates == []


def test_multipart_mail_reads_only_the_text_part_and_its_revision_header() -> None:
    facts = parse_eml(sample_eml("multipart"))
    assert facts.source.revision == 2
    dumped = facts.model_dump_json()
    assert "JVBERi0" not in dumped  # the attachment
    assert "<html>" not in dumped


def test_unambiguous_numeric_date_and_case_insensitive_labels_resolve() -> None:
    facts = _facts(_eml("ARRIVAL DATE: 25/03/2026\nroom type: deluxe king\n"))
    assert facts["arrival_date"].value == "2026-03-25"
    assert facts["room_type"].value == "Deluxe King"


def test_contradicting_repeated_label_and_garbage_values_are_not_recoverable() -> None:
    facts = _facts(_eml("Adults: 2\nAdults: 3\nRoom Count: two\nArrival Date: soon\nCurrency: dollars\n"))
    for name in ("adults", "room_count", "arrival_date", "currency"):
        assert facts[name].status == FactStatus.UNRESOLVED, name
        assert facts[name].recoverability == Recoverability.NOT_RECOVERABLE, name
        assert facts[name].evidence, name


def test_date_without_year_and_without_sent_date_is_not_recoverable() -> None:
    facts = _facts(_eml("Arrival Date: 05/03\n", headers="Message-ID: <m2@x.example>\n"))
    assert facts["arrival_date"].recoverability == Recoverability.NOT_RECOVERABLE


def test_mail_without_message_id_or_text_part_is_refused() -> None:
    with pytest.raises(EmlInvalid) as exc:
        parse_eml(b"Subject: x\nContent-Type: text/plain\n\nAdults: 2\n")
    assert exc.value.code == "eml_invalid"
    with pytest.raises(EmlInvalid):
        parse_eml(b"Message-ID: <a@b>\nContent-Type: text/html\n\n<p>Adults: 2</p>\n")


def test_observation_hash_is_stable_and_changes_with_what_was_observed() -> None:
    a = parse_eml(sample_eml("ambiguous")).observation_hash
    assert a == parse_eml(sample_eml("ambiguous")).observation_hash
    changed = sample_eml("ambiguous").replace(b"Adults: 2", b"Adults: 3")
    assert parse_eml(changed).observation_hash != a
