"""The `kvfleet` command line, run as a user would: real subprocesses."""
from __future__ import annotations

import hashlib
import json
import os
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
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    kvfleet("make-tiny-model", str(a), "--seed", "3", *SMALL)
    kvfleet("make-tiny-model", str(b), "--seed", "3", *SMALL)
    kvfleet("make-tiny-model", str(c), "--seed", "4", *SMALL)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(digest(a))
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 2


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
    and every process it started exits with it; none is left orphaned."""
    from tests.cli.test_up import _alive, children_of   # noqa: PLC0415
    from services.cli.launcher import wait_until         # noqa: PLC0415
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "demo", "--fleet", "--model",
         str(tiny_model_dir), "--chats", "400", "--rate", "2", "--documents", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("kvfleet up ("):
                break
        kids = children_of(proc.pid)
        assert len(kids) == 4                                  # prefill, decode, router, gateway
        os.kill(proc.pid, signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert "fleet stopped" in rest
        assert wait_until(lambda: not any(_alive(k) for k in kids), 5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
