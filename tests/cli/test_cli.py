"""The `kvfleet` command line, run as a user would: real subprocesses."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "600",
         "--max-positions", "2048"]


def kvfleet(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", *args],
                          capture_output=True, text=True, timeout=300, check=check)


def digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_make_tiny_model_is_byte_identical_for_a_seed(tmp_path):
    """The command and the library, in two processes (a fresh one and this test's, whatever its
    state), write the same bytes for one seed; another seed writes other weights."""
    from services.engine.tiny_model import make_tiny_model   # noqa: PLC0415
    made = tmp_path / "made"
    kvfleet("make-tiny-model", str(made), "--seed", "3", *SMALL)
    shape = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=600, max_positions=2048)
    same = make_tiny_model(tmp_path / "same", seed=3, **shape)
    other = make_tiny_model(tmp_path / "other", seed=4, **shape)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(digest(made))
    assert digest(made) == digest(same)
    assert digest(made)["model.safetensors"] != digest(other)["model.safetensors"]
    assert json.loads((made / "config.json").read_text())["num_hidden_layers"] == 2


def test_generate_prints_one_json_object_per_prompt(tiny_model_dir):
    run = kvfleet("generate", "--model", str(tiny_model_dir), "--prompt-ids", "5,6,7,8",
                  "--prompt-ids", "9,10", "--max-tokens", "5", "--logprobs", "2", "--echo",
                  "--json")
    docs = [json.loads(line) for line in run.stdout.splitlines()]
    assert [d["prompt_token_ids"] for d in docs] == [[5, 6, 7, 8], [9, 10]]
    for d in docs:
        assert len(d["token_ids"]) == len(d["logprobs"]) == 5
        assert all(lp <= 0 for lp in d["logprobs"])
        assert all(len(top) == 2 for top in d["top_logprobs"])
        assert d["prompt_logprobs"][0] is None
        assert len(d["prompt_logprobs"]) == len(d["prompt_token_ids"])
        assert isinstance(d["text"], str)


def test_generate_matches_the_python_api(tiny_model_dir):
    from services.engine.engine import LLMEngine, engine_config
    from services.engine.sampling_params import SamplingParams
    run = kvfleet("generate", "--model", str(tiny_model_dir), "--prompt", "Hello there",
                  "--max-tokens", "8", "--temperature", "0.8", "--seed", "11", "--json")
    doc = json.loads(run.stdout)
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
    (out,) = engine.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.8,
                                                            seed=11, logprobs=0))
    assert doc["token_ids"] == out.token_ids and doc["text"] == out.text


@pytest.mark.parametrize("args, code", [
    (["--prompt", ""], "empty_prompt"),
    (["--prompt-ids", "1,999999"], "token_out_of_vocab"),
    (["--prompt", "hi", "--max-tokens", "0"], "invalid_max_tokens"),
])
def test_generate_reports_bad_input_as_a_json_error(tiny_model_dir, args, code):
    run = kvfleet("generate", "--model", str(tiny_model_dir), *args, "--json", check=False)
    assert run.returncode == 2
    err = json.loads(run.stderr.strip().splitlines()[-1])["error"]
    assert err["code"] == code and err["message"]


def test_sigterm_to_a_command_that_launched_a_fleet_stops_the_fleet_too(tiny_model_dir):
    """`kvfleet demo --fleet` mid-run gets SIGTERM (as from a CI timeout or `kill`): it exits,
    and every process it started exits with it; none is left orphaned. (Its workers on the
    simulated engine core: the claim is about processes, not tokens.)"""
    from services.cli.launcher import children, running   # noqa: PLC0415
    from tests.waiting import wait_until         # noqa: PLC0415
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "demo", "--fleet", "--engine", "sim",
         "--model", str(tiny_model_dir), "--chats", "400", "--rate", "2", "--documents", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("kvfleet up ("):
                break
        kids = children(proc.pid)
        redis = shutil.which("redis-server") is not None     # else the demo's Redis is a thread
        assert len(kids) == 4 + redis                # prefill, decode, router, gateway (redis)
        os.kill(proc.pid, signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert "fleet stopped" in rest
        assert wait_until(lambda: not any(running(k) for k in kids), 5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_kvfleet_help_imports_neither_torch_nor_the_load_tester():
    code = ("import sys; from services.cli.cli import build_parser; build_parser(); "
            "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('loadtests')]; "
            "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: kvfleet bench serve" in kvfleet("bench", "serve", "--help").stdout


def test_a_delegated_subcommand_parses_its_own_arguments():
    run = kvfleet("bench", "serve", "--workload", "chat-only", check=False)   # no --endpoint
    assert run.returncode == 2 and "kvfleet bench serve: error" in run.stderr
    assert "--endpoint" in run.stderr
    run = kvfleet("generate", "--no-such-flag", check=False)
    assert run.returncode == 2 and "unrecognized arguments: --no-such-flag" in run.stderr


def test_bench_fleet_json_leads_with_what_the_fleet_adds():
    from services.cli.fleet_bench import Side, bench_result
    fleet = Side(ttft_s=[0.010, 0.014, 0.012], per_token_s=[0.003, 0.002], tok_s=900.0)
    engine = Side(ttft_s=[0.009, 0.008, 0.0085], per_token_s=[0.0015, 0.0015], tok_s=1000.0)
    r = json.loads(json.dumps(bench_result(fleet, engine, mode="disagg", kv_backend="tcp")))
    assert list(r)[:4] == ["added_ttft_ms", "added_per_token_ms", "fleet_tok_s", "engine_tok_s"]
    assert r["added_ttft_ms"] == pytest.approx(12.0 - 8.5)               # medians, fleet - engine
    assert r["added_per_token_ms"] == pytest.approx(2.5 - 1.5)
    assert (r["fleet_tok_s"], r["engine_tok_s"], r["fleet_over_engine_tok_s"]) == (900.0, 1000.0, 0.9)
    assert (r["mode"], r["kv_backend"]) == ("disagg", "tcp")
    assert r["fleet"]["samples"] == {"ttft": 3, "per_token": 2}
