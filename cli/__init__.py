"""The `agent-recovery` command line: one module per command family, wired in cli.main."""
