"""SuperAgent field recovery (docs/field-recovery.md): bounded call, persistent idempotency, apply-once.

Modules, one concept each: schemas (contracts), eml (deterministic parser), request_builder,
answer (strict PatchSet parsing), validator, resolver, assembly, projector, client (Open API on
requests), sse (linear SSE framing and parsing), transport (watched sessions, proxy, resolver,
capped bodies), deadline (total deadline + watchdog), store (invocation record), artifacts,
tables (their own MetaData), orchestrator (the MANUAL_EML pipeline), errors, logs.
The SuperAgent stand-in is a test double and lives in ``doubles/superagent.py``.
"""
