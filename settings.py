"""The one place environment variables are read (docs/architecture.md).

Every name below is a public interface: operators and scripts set these variables. Invalid
values fail at start with a message that names the variable (``SettingsError``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Upper bound of booking.field-recovery.max-wait: it must be > 0 and capped (docs/field-recovery.md).
FIELD_RECOVERY_MAX_WAIT_CAP_SECONDS = 600.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any) -> Any:
    """Accept ``120``, ``120s``, ``100ms``, ``2m`` or ``1h``; return seconds as float."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError("expected a duration such as 120, 120s, 100ms, 2m")
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


#: Seconds, written as a number or with a unit suffix (ms, s, m, h).
Duration = Annotated[float, BeforeValidator(parse_duration)]


#: Hosts to which an ``http://`` field-recovery base URL may point (the key travels in clear).
_LOOPBACK_HOSTS = ("localhost", "::1")


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host.lower() in _LOOPBACK_HOSTS or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OpenApiSettings(BaseModel):
    """booking.field-recovery.open-api.* — the parsing agent's own external application."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = "https://superagent.nianxx.cn"
    #: The parsing agent's own df_open_ secret. Never borrowed from another agent's key; masked in
    #: repr() and model_dump() (``.get_secret_value()`` is called only where the header is built).
    api_key: SecretStr = SecretStr("")
    connect_timeout: Duration = 15.0
    sse_recovery_max_attempts: int = Field(default=5, ge=0, le=50)
    include_trace: bool = False
    #: An ``http://[user:pass@]host:port`` HTTP CONNECT proxy for an https:// platform; empty: no
    #: proxy. Proxy variables of the environment (HTTPS_PROXY ...) are never used. Secret: it may
    #: carry the proxy's credentials.
    proxy: SecretStr = SecretStr("")
    #: A PEM file of the CA certificates that verify the platform; empty: certifi's bundle.
    #: REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE of the environment are never used.
    ca_bundle: str = ""

    @model_validator(mode="after")
    def _check(self) -> OpenApiSettings:
        from urllib.parse import urlsplit

        if self.proxy.get_secret_value():
            proxy = urlsplit(self.proxy.get_secret_value())
            if proxy.scheme != "http" or not proxy.hostname or proxy.path not in ("", "/"):
                raise ValueError("BOOKING_FIELD_RECOVERY__OPEN_API__PROXY must be an http://host:port CONNECT proxy")
            if not self.base_url.startswith("https://"):
                raise ValueError(
                    "BOOKING_FIELD_RECOVERY__OPEN_API__PROXY needs an https:// BASE_URL (the key would reach the proxy)"
                )
        if self.ca_bundle and not Path(self.ca_bundle).is_file():
            raise ValueError("BOOKING_FIELD_RECOVERY__OPEN_API__CA_BUNDLE must name a readable PEM file")

        if self.connect_timeout <= 0:
            raise ValueError("BOOKING_FIELD_RECOVERY__OPEN_API__CONNECT_TIMEOUT must be > 0")
        if self.base_url:
            url = urlsplit(self.base_url)
            if url.scheme not in ("https", "http") or not url.hostname:
                raise ValueError("BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL must be an https:// URL")
            if url.scheme == "http" and not _is_loopback(url.hostname):
                raise ValueError(
                    "BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL must use https:// unless the host is loopback "
                    "(the Bearer key would travel in clear)"
                )
        return self


class EmlLimitSettings(BaseModel):
    """booking.field-recovery.eml.* — bounds of the EML parser; a file past one is ``eml_too_large``."""

    model_config = ConfigDict(extra="forbid")

    #: Bytes of one EML file, read before anything is parsed.
    max_input_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    #: MIME parts counted over the whole file (every part of every multipart).
    max_parts: int = Field(default=100, gt=0, le=100_000)
    #: Multiparts nested inside one another (the message itself is depth 0).
    max_depth: int = Field(default=8, gt=0, le=1000)
    #: Bytes of one header section (the message's or a part's).
    max_header_bytes: int = Field(default=64 * 1024, gt=0)


class FieldRecoverySettings(BaseModel):
    """booking.field-recovery.* (docs/field-recovery.md, "Configuration")."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    profile_version: str = "fixed-channel-field-recovery-qbd-v1"
    open_api: OpenApiSettings = OpenApiSettings()
    max_wait: Duration = 120.0
    poll_interval: Duration = 0.1
    max_message_chars: int = Field(default=200_000, gt=0)
    max_response_chars: int = Field(default=200_000, gt=0)
    #: PostgreSQL schema that holds the invocation and artifact tables.
    db_schema: str = Field(default="th_hotel_booking", pattern=r"^[a-z_][a-z0-9_]*$")
    #: Off by default: an expired IN_PROGRESS owner may be taken over with a fencing epoch.
    stale_takeover: bool = False
    #: Lease of an invocation owner; renewed while the provider call runs.
    lease_seconds: Duration = 30.0
    #: Days an invocation and its artifacts are kept (retention_until); then field.purge_expired
    #: deletes them.
    retention_days: int = Field(default=90, gt=0, le=3650)
    #: Limits of the EML parser (input bytes, parts, nesting depth, header bytes).
    eml: EmlLimitSettings = EmlLimitSettings()

    @model_validator(mode="after")
    def _check(self) -> FieldRecoverySettings:
        if not 0 < self.max_wait <= FIELD_RECOVERY_MAX_WAIT_CAP_SECONDS:
            raise ValueError(
                f"BOOKING_FIELD_RECOVERY__MAX_WAIT must be > 0 and <= {FIELD_RECOVERY_MAX_WAIT_CAP_SECONDS:g}s"
            )
        if self.poll_interval <= 0:
            raise ValueError("BOOKING_FIELD_RECOVERY__POLL_INTERVAL must be > 0")
        if self.lease_seconds <= 0:
            raise ValueError("BOOKING_FIELD_RECOVERY__LEASE_SECONDS must be > 0")
        if self.enabled and not self.open_api.api_key.get_secret_value():
            raise ValueError(
                "BOOKING_FIELD_RECOVERY__OPEN_API__API_KEY is required when "
                "BOOKING_FIELD_RECOVERY__ENABLED=true (it is never borrowed from another agent's key)"
            )
        if self.enabled and not self.open_api.base_url:
            raise ValueError("BOOKING_FIELD_RECOVERY__OPEN_API__BASE_URL is required when enabled")
        return self


class Settings(BaseSettings):
    """Process configuration. Field names are the environment variable names."""

    model_config = SettingsConfigDict(
        case_sensitive=False, env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    DATABASE_URL: str = Field(
        default="postgresql+psycopg2://postgres@127.0.0.1:5432/postgres",
        description="State database (SQLAlchemy URL); PostgreSQL in production, SQLite only for the demo.",
    )
    DB_POOL_SIZE: int = Field(
        default=0,
        ge=0,
        description=(
            "Connections each process keeps open to DATABASE_URL (0: derived from the loops the process "
            "runs at once: Celery's -c on a threads pool, 1 on prefork; docs/scaling.md)."
        ),
    )
    DB_POOL_MAX_OVERFLOW: int = Field(
        default=-1,
        ge=-1,
        description=(
            "Connections opened beyond DB_POOL_SIZE in a burst and closed after (-1: derived); a process never "
            "holds more than both, and a thread that finds none free waits up to half a lease, then ends its "
            "task as an infrastructure fault."
        ),
    )
    DB_SETTINGS_SCOPE: Literal["session", "transaction"] = Field(
        default="session",
        description=(
            "Where the server-side bounds of every connection are sent: session (libpq options at connect: "
            "PostgreSQL directly, or PgBouncer in session mode) or transaction (SET LOCAL at each "
            "transaction's start: PgBouncer in transaction mode, which keeps no session state)."
        ),
    )
    CELERY_BROKER_URL: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Celery broker: Redis (redis://) or RabbitMQ (amqp://); filesystem:// only for the demo.",
    )
    CELERY_RESULT_BACKEND: str = Field(
        default="redis://127.0.0.1:6379/1",
        description="Celery result backend (task results; our tasks store few): Redis, or db+sqlite for the demo.",
    )
    CELERY_FS_FOLDER: str = Field(
        default="/tmp/agent-recovery-broker",
        description="Folder of the filesystem:// broker, the demo's embedded default only.",
    )
    REDIS_URL: str = Field(
        default="redis://127.0.0.1:6379/2", description="Redis of session_status events and LOCAL client presence."
    )
    MODEL_BASE_URL: str = Field(
        default="http://127.0.0.1:8765/v1", description="OpenAI-compatible chat-completions endpoint (ending in /v1)."
    )
    MODEL_API_KEY: str = Field(
        default="", repr=False, description="The model provider's key, sent as a Bearer token; never logged."
    )
    MODEL_NAME: str = Field(default="scripted", description="Model name sent when an agent does not name one.")
    MODEL_CONNECT_TIMEOUT_SECONDS: float = Field(
        default=5.0, gt=0, description="Longest a model call waits to connect; capped by the time left to a deadline."
    )
    MODEL_READ_TIMEOUT_SECONDS: float = Field(
        default=120.0,
        gt=0,
        description="Longest a model call waits between bytes of the answer; capped by the time left to a deadline.",
    )
    MODEL_MAX_RETRIES: int = Field(
        default=4,
        ge=0,
        le=20,
        description=(
            "Retries of a model call after HTTP 408, 409, 429, any 5xx, x-should-retry: true, a 200 whose"
            " body is an error object, or a connection error (0: none); each waits Retry-After or an "
            "exponential backoff with jitter, within the call's absolute deadline."
        ),
    )
    MODEL_RETRY_MAX_SECONDS: float = Field(
        default=60.0,
        ge=0,
        description="No retry starts a wait that would end more than this long after the call's first attempt.",
    )
    MODEL_READ_TIMEOUT_RETRIES: int = Field(
        default=2,
        ge=0,
        le=10,
        description=(
            "Retries of a model call whose answer did not come within MODEL_READ_TIMEOUT_SECONDS (each is "
            "billed by the provider); past them the run fails with the reason read_timeout."
        ),
    )
    MODEL_PRICES_FILE: str = Field(
        default="",
        description=(
            "TOML or JSON file of prices per model (input, cached_input, output: USD per million tokens); "
            "gives usage in USD and makes usd budgets possible. Empty: no prices."
        ),
    )
    AGENTS_FILE: str = Field(
        default="",
        description="TOML file with [agents.NAME] tables; empty means the built-in main, reviewer and researcher.",
    )
    TOOL_MODULES: str = Field(
        default="",
        description=(
            "Comma-separated modules of @tool functions that every process imports at start "
            "(pkg.tools,other.tools); installed packages may also use the entry point group "
            "agent_recovery.tools."
        ),
    )
    MODEL_OUTAGE_MAX_SECONDS: float = Field(
        default=3600.0,
        gt=0,
        description=(
            "A provider outage longer than the retry window ends a run without a result; the session is "
            "resumed with back-off until its deadline or this long after the outage began, then FAILED."
        ),
    )
    AGENT_RELEASE_POLICY: Literal["pinned", "latest"] = Field(
        default="pinned",
        description=(
            "pinned: a session keeps the agent release it started in until an operator moves it "
            "(sessions upgrade); latest: a session moves to the worker's release, when newer, at its "
            "next round boundary (docs/releases.md)."
        ),
    )
    RELEASE_WAIT_SECONDS: float = Field(
        default=3600.0,
        gt=0,
        description=(
            "A session of a newer release than the worker's, whose tools the worker does not all have, "
            "waits for a worker of its release (resumed with back-off) this long, then ends FAILED "
            "release_unavailable."
        ),
    )
    TOOL_MAX_RERUNS: int = Field(
        default=3,
        ge=0,
        description=(
            "Times a recovered loop may run one journaled read-only or idempotent call again after a "
            "crash interrupted it; past that the call is reported interrupted and the model decides."
        ),
    )
    TOOL_MAX_RETRIES: int = Field(
        default=2,
        ge=0,
        description=(
            "Rounds in a row a tool's arguments may be answered 'fix them' (not JSON, or not what the tool "
            "takes) when its @tool(max_retries=...) says nothing (MCP tools too); one more and the session fails "
            "with the reason tool_arguments."
        ),
    )
    TOOL_TIMEOUT_SECONDS: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Longest a tool call may run when its @tool(timeout_seconds=...) says nothing; a call still "
            "running then is reported timed out, may or may not have taken effect."
        ),
    )
    TOOL_RESULT_MAX_CHARS: int = Field(
        default=100_000, ge=1000, description="Longest TOOL result kept; a longer one is cut, with a note where."
    )
    TOOL_MAX_STUCK_THREADS: int = Field(
        default=20,
        ge=1,
        description=(
            "Tool threads a process may leave running past their call (timed out or cancelled: a thread cannot "
            "be stopped); past this many the worker finishes its task and stops, so that its supervisor starts "
            "a fresh one."
        ),
    )
    SUBAGENT_TIMEOUT_SECONDS: float = Field(
        default=3600.0,
        gt=0,
        description="A child's absolute deadline, counted from its started_at and never reset by a restart.",
    )
    SUBAGENT_CANCEL_GRACE_SECONDS: float = Field(
        default=30.0,
        ge=0,
        description="Grace after a child's deadline (outside it) before the scan takes it from a live owner.",
    )
    APPROVAL_TIMEOUT_SECONDS: float = Field(
        default=86400.0,
        gt=0,
        description=(
            "How long a tool call's approval request waits for a human decision; past it the call is "
            "denied with the reason expired (a child's request also expires at its deadline)."
        ),
    )
    APPROVAL_RETENTION_DAYS: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Decided approval requests of closed rounds are deleted this long after their decision (the beat "
            "task approval.purge_decided, hourly)."
        ),
    )
    APPROVAL_NAME_TO_MODEL: bool = Field(
        default=False,
        description=(
            "Send the approver's name to the model in the TOOL result of a denial or an edited approval "
            "(denied by NAME: REASON); off: 'denied by an approver: REASON'."
        ),
    )
    APPROVAL_WEBHOOK_URL: str = Field(
        default="",
        description=(
            "POSTed (JSON: the request's id, session, call, tool, agent and expiry; never its arguments) when an "
            "approval request is created, signed with APPROVAL_WEBHOOK_SECRET, retried with back-off; empty: none."
        ),
    )
    APPROVAL_WEBHOOK_SECRET: SecretStr = Field(
        default=SecretStr(""),
        description=(
            "HMAC-SHA256 key of the approval webhook: the header X-Agent-Recovery-Signature is "
            "sha256=HEX of the body under it."
        ),
    )
    APPROVAL_WEBHOOK_TIMEOUT_SECONDS: float = Field(
        default=10.0, gt=0, description="How long one POST of the approval webhook may take before it is retried."
    )
    LEASE_SECONDS: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Lease of a running loop, renewed every third of it while the loop makes progress; every "
            "other duration of recovery derives from it (at least 3)."
        ),
    )
    SCAN_INTERVAL_SECONDS: float = Field(default=30.0, gt=0, description="Beat interval of recovery.scan.")
    RECOVERY_BATCH_PASS_ON_SECONDS: float = Field(
        default=0.25,
        gt=0,
        description=(
            "A recovery message runs its round's children one after another; those not started this long "
            "after the first began are passed on, a message each."
        ),
    )
    WORKER_ID: str = Field(
        default="",
        description=(
            "Stable name of this worker across restarts (default: Celery's node name, -n); a worker that "
            "boots again under its name takes back its previous process's work at once."
        ),
    )
    RECOVERY_QUEUE: str = Field(
        default="recovery",
        description=(
            "Queue of scans, fan-out batches, deliveries and redeliveries (short work; a worker without -Q serves it)."
        ),
    )
    CLOCK_SKEW_SECONDS: float = Field(
        default=0.0,
        description=(
            "Tests only: shift this process's clock, as a badly set machine would (leases and deadlines "
            "use the database's time anyway)."
        ),
    )
    CRASH_POINT: str = Field(
        default="",
        description=(
            "Tests, soak and demo only: the named crash point to die at (crashpoints.py, which reads it "
            "itself with CRASH_POINT_AFTER and CRASH_POINT_MODE); empty in production."
        ),
    )
    LOG_LEVEL: str = Field(
        default="INFO",
        description=(
            "Level of the log lines of workers and beat (DEBUG, INFO, WARNING, ERROR): our setup_logging "
            "receiver configures logging, so Celery's -l does not set it."
        ),
    )
    CONSOLE_TOKEN: SecretStr = Field(
        default=SecretStr(""),
        description=(
            "The console's operator token (also accepted as Authorization: Bearer); required unless the "
            "console listens on loopback only."
        ),
    )
    CONSOLE_TOKEN_FILE: str = Field(
        default="", description="A file holding the console's operator token, instead of CONSOLE_TOKEN."
    )
    CONSOLE_READ_ONLY: bool = Field(
        default=False, description="The console shows and accepts no action (cancel, redeliver, approve, deny)."
    )
    CONSOLE_SHOW_CONTENT: bool = Field(
        default=False,
        description="The console shows message content (the users' data); otherwise roles, tool names and sizes.",
    )

    CONSOLE_SESSION_HOURS: float = Field(
        default=12.0, gt=0, description="Hours a console sign-in lasts; then the operator signs in again."
    )
    CONSOLE_OPERATORS_FILE: str = Field(
        default="",
        description=(
            "A TOML or JSON file of the console's operators (name, role viewer/approver/admin, token_hash from "
            "agent-recovery console hash-token): each signs in as themselves and acts within their role; "
            "CONSOLE_TOKEN is then not accepted."
        ),
    )
    HEALTH_APPROVAL_MAX_AGE_SECONDS: float = Field(
        default=3600.0,
        gt=0,
        description="Health turns red when an approval request has waited longer than this for a decision.",
    )
    CONSOLE_ALLOWED_HOSTS: str = Field(
        default="",
        description=(
            "Comma-separated host names the console answers besides loopback names and the address it listens "
            "on (console.example.com,.ops.example: a leading dot allows every name under it); a request naming "
            "any other Host is refused (DNS rebinding)."
        ),
    )

    #: booking.field-recovery.*, env BOOKING_FIELD_RECOVERY__<NAME>[__<NAME>].
    booking_field_recovery: FieldRecoverySettings = Field(
        default_factory=FieldRecoverySettings,
        description="SuperAgent field recovery (docs/field-recovery.md): BOOKING_FIELD_RECOVERY__<NAME>[__<NAME>].",
    )

    @model_validator(mode="after")
    def _check_urls(self) -> Settings:
        for name in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "MODEL_BASE_URL"):
            if "://" not in getattr(self, name):
                raise ValueError(f"{name} must be a URL (scheme://...)")
        if self.LEASE_SECONDS < 3:
            raise ValueError("LEASE_SECONDS must be at least 3 (the heartbeat renews at a third of it)")
        return self


class SettingsError(RuntimeError):
    """The environment holds an invalid setting; the message names the variable."""


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc and loc[0] == "booking_field_recovery":
            loc[0] = "BOOKING_FIELD_RECOVERY"
            name = "__".join(p.upper() for p in loc)
        else:
            name = "__".join(loc) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{name}: {msg}" if name not in msg else msg)
    return "invalid configuration: " + "; ".join(parts)


def load_settings(**overrides: Any) -> Settings:
    """Read and validate the environment; raise SettingsError naming the bad variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once. Tests call ``get_settings.cache_clear()``."""
    return load_settings()
