"""What a user would write or install instead of a Conveyor connector, one script each.

Each runs as its own process (so that its CPU time and memory are its own), drains a
topic into a target and exits once ``--n`` messages are in (or when killed). They are
the baselines of bench/test_bench_as_users_run_it.py.
"""
