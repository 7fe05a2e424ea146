"""Helpers shared by the field-recovery tests (moved out of the product package; no pytest import)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from fieldrecovery.schemas import SourceRef
from fieldrecovery.tables import DEFAULT_SCHEMA, ArtifactType, FieldBase
from fieldrecovery.tables import FieldRecoveryArtifact as Art
from models.db import get_engine

#: tests/data, where the sample EML files live.
DATA_DIR = Path(__file__).resolve().parent / "data"


def sample_eml(name: str) -> bytes:
    """A sample EML by name: ``ambiguous``, ``clean`` or ``multipart``."""
    return (DATA_DIR / f"field_booking_{name}.eml").read_bytes()


def clean_field_tables(url: str, schema: str = DEFAULT_SCHEMA) -> None:
    """Empty the field-recovery tables (the core ``db`` fixture does not know this schema)."""
    names = ", ".join(f'"{schema}"."{t.name}"' for t in FieldBase.metadata.sorted_tables)
    with get_engine(url).begin() as conn:
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY"))


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; returns its last value."""
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


# --- the Open API client against the stand-in (test_field_client, test_field_real_servers) ------


class SampleCall:
    """The ambiguous sample booking as the client sends it: facts, request, message, subject."""

    def __init__(self, name: str = "ambiguous") -> None:
        from fieldrecovery.eml import parse_eml
        from fieldrecovery.request_builder import build_request, render_message
        from fieldrecovery.schemas import sha256_hex

        self.facts = parse_eml(sample_eml(name))
        request = build_request(self.facts, profile_version="pv1")
        assert request is not None
        self.request = request
        self.message = render_message(request)
        self.subject = sha256_hex(self.facts.source.message_id)


def open_api_client(
    base_url: str, key: str, max_response_chars: int = 200_000, resolver: Any = None, **open_api: object
) -> Any:
    from fieldrecovery.client import OpenApiClient
    from settings import OpenApiSettings

    settings = OpenApiSettings.model_validate({"base_url": base_url, "api_key": key, **open_api})
    if resolver is None:
        return OpenApiClient(settings, max_response_chars=max_response_chars)
    return OpenApiClient(settings, max_response_chars=max_response_chars, resolver=resolver)


def call_provider(
    client: Any, sample: SampleCall, seconds: float = 5.0, progress: Any = None, stop: Any = None
) -> tuple[Any, Any]:
    """One ``client.recover`` of the sample under a ``seconds`` deadline; (answer, progress)."""
    from fieldrecovery.client import CallProgress
    from fieldrecovery.deadline import Deadline

    progress = progress or CallProgress()
    kwargs = {"stop": stop} if stop is not None else {}
    answer = client.recover(
        sample.message,
        idempotency_key=sample.request.idempotency_key,
        subject_id=sample.subject,
        deadline=Deadline(seconds),
        progress=progress,
        **kwargs,
    )
    return answer, progress


def list_artifacts(s: Session, source: SourceRef) -> list[tuple[ArtifactType, dict[str, Any]]]:
    """The source's artifacts in write order."""
    rows = s.execute(
        select(Art.artifact_type, Art.content)
        .where(Art.source_message_id == source.message_id, Art.source_revision == source.revision)
        .order_by(Art.id)
    ).all()
    return [(ArtifactType(r.artifact_type), r.content) for r in rows]
