"""The runnable demo (`make demo`) and the process stack it shares with tests and benchmarks:
scripted model server, Celery worker subprocesses, service environment."""
