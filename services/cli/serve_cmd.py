"""`kvfleet serve ROLE` and `python -m services.prefill|decode|mixed`: the one place that knows the
roles by name. It picks the role (ROLES) and hands it to the worker (services/worker/serve.py,
build.py), which serves whatever Role it is given.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from services.decode.reservations import DecodeRole
from services.mixed.generate import MixedRole
from services.prefill.handler import PrefillRole
from services.worker.role import Role

# role name -> a new role, not yet started
ROLES: dict[str, Callable[[], Role]] = {
    "prefill": PrefillRole,
    "decode": DecodeRole,
    "mixed": MixedRole,
}


def role_named(name: str) -> Role:
    """A new role of that name; ValueError names the roles there are."""
    if name not in ROLES:
        raise ValueError(f"no worker role {name!r}; the roles are {', '.join(ROLES)}")
    return ROLES[name]()


def run_worker(args: argparse.Namespace) -> NoReturn:
    """`kvfleet serve`: one worker process until it is told to stop; then it ends at once,
    without the interpreter's teardown (services/protocol/shutdown.py exit_now)."""
    from services.protocol.aio import run  # noqa: PLC0415
    from services.protocol.shutdown import exit_now  # noqa: PLC0415
    from services.worker.serve import serve  # noqa: PLC0415
    exit_now(run(serve(args, role_named(args.role))))


def main(role: str, argv: list[str] | None = None) -> NoReturn:
    """`python -m services.ROLE [ARGS]`: `kvfleet serve ROLE [ARGS]`."""
    from services.worker.serve import add_worker_args  # noqa: PLC0415
    parser = argparse.ArgumentParser(prog=f"kvfleet serve {role}")
    add_worker_args(parser, role)
    run_worker(parser.parse_args(argv))
