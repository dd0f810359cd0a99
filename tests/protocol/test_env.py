"""The environment variables kvfleet reads are one table (services/protocol/env.py): no module
reads one by name around it, and every KVFLEET_* name the code mentions is in it."""
from __future__ import annotations

import re
from pathlib import Path

from services.protocol import env

ROOT = Path(__file__).resolve().parents[2]
# The vLLM scripts (check_vllm_*, vllm_pair) configure vLLM (another program, run beside
# kvfleet), not kvfleet.
SOURCES = [p for d in ("services", "loadtests") for p in (ROOT / d).rglob("*.py")
           if p != ROOT / "services" / "protocol" / "env.py" and "_pb2" not in p.name
           and not p.name.startswith(("check_vllm_", "vllm_"))]
DIRECT_READ = re.compile(r"os\.getenv\(|os\.environ\.(get|pop|setdefault)\(|os\.environ\[")


def test_the_table_names_each_variable_once_with_its_reader_and_purpose():
    names = [v.name for v in env.TABLE]
    assert len(names) == len(set(names))
    assert all(v.read_by and v.purpose for v in env.TABLE)


def test_no_module_reads_a_variable_around_the_table():
    direct = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES
              for n, line in enumerate(p.read_text().splitlines(), 1) if DIRECT_READ.search(line)]
    assert direct == []


def test_every_kvfleet_variable_the_code_names_is_in_the_table():
    named = {m for p in SOURCES for m in re.findall(r"[\"'](KVFLEET_[A-Z0-9_]+)[\"']", p.read_text())}
    assert named <= {v.name for v in env.TABLE}, named - {v.name for v in env.TABLE}


def test_a_var_reads_the_given_environment_or_this_process_s():
    assert env.METRICS.get({"KVFLEET_METRICS": "off"}) == "off"
    assert env.METRICS.get({}, "on") == "on"
