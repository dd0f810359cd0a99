"""Every container the chart renders runs a real kvfleet command: its command line, with the
variables Kubernetes expands in it, is parsed by the real argument parser of that service, so a
renamed or removed flag fails here rather than in a crash-looping pod."""
from __future__ import annotations

import argparse
import re
import signal

import pytest

from tests.helm.chart import VALUE_SETS, pod_specs, render, values_of

pytest.importorskip("helm_python")

# What the variables in a command line stand for in a pod (Kubernetes expands $(NAME) from the
# container's env; the LWS controller injects LWS_WORKER_INDEX into every pod of a group).
INJECTED = {"LWS_WORKER_INDEX": "1"}
SAMPLE = {"POD_IP": "10.1.2.3", "POD_NAME": "ci-kvfleet-decode-7d9f-abcde",
          "KVFLEET_REDIS_URL": "redis://:pw@ci-kvfleet-redis:6379/0", **INJECTED}
VARIABLE = re.compile(r"\$\((\w+)\)")


class Parsed(Exception):
    """Raised by the parser in place of running the service: the arguments it parsed."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.namespace = namespace


@pytest.fixture
def parse_only(monkeypatch):
    """ArgumentParser.parse_args parses for real, then stops before the service would start
    (a named stand-in for the service's run, nothing else is replaced)."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    sigterm = signal.getsignal(signal.SIGTERM)      # `kvfleet` sets its own SIGTERM handler
    yield
    signal.signal(signal.SIGTERM, sigterm)


def entry_point(command: list[str]):
    """The function a container's command runs, given its arguments."""
    match command:
        case ["kvfleet"]:
            from services.cli.cli import main
        case ["python", "-m", "services.router"]:
            from services.router.__main__ import main
        case ["python", "-m", "services.gateway"]:
            from services.gateway.__main__ import main
        case ["python", "-m", "services.engine.tp_ranks"]:
            from services.engine.tp_ranks import main
        case _:
            raise AssertionError(f"not a kvfleet command: {command}")
    return main


def kvfleet_containers(value_set: str):
    for obj in render(value_set).objects:
        for where, spec in pod_specs(obj):
            for c in spec["containers"]:
                if c["image"].startswith(values_of(value_set).get("image", {}).get("repository",
                                                                                   "kvfleet")):
                    yield f"{obj['kind']}/{obj['metadata']['name']}/{where}/{c['name']}", c


def expanded(container: dict) -> list[str]:
    """The arguments as the container sees them: every $(NAME) defined, then expanded."""
    defined = {e["name"] for e in container.get("env", [])} | set(INJECTED)
    out = []
    for arg in container.get("args", []):
        for name in VARIABLE.findall(arg):
            assert name in defined, f"$({name}) is not in the container's env"
        out.append(VARIABLE.sub(lambda m: SAMPLE[m.group(1)], arg))
    return out


def parse(container: dict) -> argparse.Namespace:
    with pytest.raises(Parsed) as parsed:
        entry_point(container["command"])(expanded(container))
    return parsed.value.namespace


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_command_line_parses_with_its_services_own_parser(value_set, parse_only):
    seen = {}
    for where, container in kvfleet_containers(value_set):
        seen[where] = parse(container)
    assert any(w.endswith("/gateway") for w in seen) and any(w.endswith("/router") for w in seen)


def test_the_parsed_worker_flags_are_the_values_asked_for(parse_only):
    values = values_of("disaggregated")
    workers = {w: c for w, c in kvfleet_containers("disaggregated") if w.endswith("/worker")}
    assert len(workers) == 2
    for where, container in workers.items():
        args = parse(container)
        assert args.role in where and args.host == SAMPLE["POD_IP"]
        assert args.tensor_parallel == values["pools"][args.role]["tensorParallel"]
        assert args.worker_id == SAMPLE["POD_NAME"] and args.redis_url == SAMPLE["KVFLEET_REDIS_URL"]


def test_the_router_runs_the_mode_of_the_release(parse_only):
    [router] = [c for w, c in kvfleet_containers("hybrid") if w.endswith("/router")]
    args = parse(router)
    assert (args.mode, args.hybrid_threshold_tokens, args.placement) == ("hybrid", 1024, "load")


def test_a_renamed_flag_fails_the_parse(parse_only):
    [worker, *_] = [c for w, c in kvfleet_containers("default") if w.endswith("/worker")]
    renamed = {**worker, "args": [a.replace("--tensor-parallel=", "--tp=") for a in worker["args"]]}
    with pytest.raises(SystemExit):
        parse(renamed)


def test_routers_and_workers_opt_in_to_their_pod_ip_which_a_default_start_refuses(parse_only):
    from services.protocol import bind
    opted = {w: parse(c) for w, c in kvfleet_containers("disaggregated")
             if w.endswith(("/worker", "/router"))}
    assert len(opted) == 3                                  # router, prefill, decode
    for where, args in opted.items():
        assert args.host == SAMPLE["POD_IP"] and args.allow_external_bind, where
        bind.check(args.host, args.allow_external_bind, where)          # the pod may bind it
        with pytest.raises(SystemExit, match="--allow-external-bind"):
            bind.check(args.host, False, where)                         # without the opt-in: no
