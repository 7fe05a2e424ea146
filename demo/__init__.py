"""The runnable demo (`make demo`, from a clone): its worker and beat processes are the ones
the tests and benchmarks run (devstack.processes)."""
