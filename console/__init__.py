"""The operator console (`agent-recovery console`): server-rendered pages and a JSON API in one
process, reading PostgreSQL. It keeps no state of its own; its actions (cancel, redeliver,
approve, deny) call the same domain functions as the CLI and the Celery tasks."""
