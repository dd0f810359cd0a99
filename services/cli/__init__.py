"""The `kvfleet` command line (cli.py) and what its subcommands run: `up` and its supervisor, the
benchmarks, the demos, status and health watching."""
