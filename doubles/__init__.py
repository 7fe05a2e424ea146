"""Test doubles: development servers that imitate our peers (a scripted OpenAI-compatible model,
a SuperAgent Open API stand-in). Real HTTP servers on loopback, used by the tests, the demo and
the benchmarks alike; nothing here runs in production."""
