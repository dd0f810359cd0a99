"""The capacity model: Llama-3-70B's memory figures, the roofline's shape, constants files, and
`kvfleet capacity` through the real CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.planner.capacity import CostModel
from services.planner.constants import Constants, load_constants
from services.planner.step_time import BatchShape

GB = 1e9


def seventy_b(**kw) -> CostModel:
    return CostModel.for_target(**{"model": "llama-3-70b", "gpu": "h200", "tp": 4, "dtype": "fp8",
                                   **kw})


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "capacity", *args],
                          capture_output=True, text=True, timeout=120)


# --- memory ------------------------------------------------------------------------------------

def test_kv_bytes_per_token_of_the_70b_shape():
    assert seventy_b(dtype="bf16").target.kv_bytes_per_token == 327_680
    assert seventy_b(dtype="fp8").target.kv_bytes_per_token == 163_840
    # the KV dtype follows the weights unless named; TP 4 splits the 8 KV heads 2 per rank
    mixed = seventy_b(dtype="fp8", kv_dtype="bf16").target
    assert (mixed.kv_bytes_per_token, mixed.kv_bytes_per_token_per_rank) == (327_680, 81_920)


def test_weights_by_precision_count_embedding_head_and_layers():
    assert seventy_b(dtype="bf16").target.weights_bytes / GB == pytest.approx(141.1, abs=0.1)
    # fp8 checkpoints keep the embedding, the LM head and the norms in bf16
    assert seventy_b(dtype="fp8").target.weights_bytes / GB == pytest.approx(72.7, abs=0.1)


def test_h200_tp4_fp8_holds_about_2_6_million_tokens_of_kv():
    model = seventy_b()
    assert 2.4e6 <= model.kv_tokens_per_replica <= 2.8e6
    assert 70 <= model.concurrent_contexts(32_768) <= 85      # DESIGN: ~78 32K documents


# --- iteration time ------------------------------------------------------------------------------

def test_prefill_time_grows_faster_than_the_prompt():
    model = seventy_b()
    per_token = [model.prefill_s(n) / n for n in (4096, 8192, 16384, 32768)]
    assert per_token == sorted(per_token) and per_token[-1] > 1.2 * per_token[0]


def test_decode_step_grows_with_batch_and_context():
    model = seventy_b()
    assert model.decode_step_s(64, 2048) < model.decode_step_s(128, 2048)
    assert model.decode_step_s(64, 2048) < model.decode_step_s(64, 8192)


def test_an_empty_batch_takes_no_time():
    assert seventy_b().step_s(BatchShape()) == 0.0


def test_kv_transfer_of_a_32k_document_over_one_400g_nic():
    # DESIGN: 233 ms in bf16; eight NICs divide it
    model = seventy_b(dtype="bf16")
    assert model.transfer_s(32_768, 400) == pytest.approx(0.233, rel=0.01)
    assert model.transfer_s(32_768, 3200) == pytest.approx(model.transfer_s(32_768, 400) / 8)


chunks = st.tuples(st.integers(1, 4096), st.integers(0, 32768))


@given(st.lists(chunks, max_size=4), st.lists(st.integers(1, 32768), max_size=64),
       st.integers(1, 512), st.integers(1, 4096))
def test_step_time_is_monotone_in_tokens_and_context(prefills, decodes, more_tokens, more_context):
    model = seventy_b()
    batch = BatchShape(tuple(prefills), tuple(decodes))
    base = model.step_s(batch)
    one_more_decode = BatchShape(batch.prefill_chunks, (*batch.decode_contexts, more_context))
    longer_contexts = BatchShape(tuple((n, c + more_context) for n, c in prefills),
                                 tuple(c + more_context for c in decodes))
    longer_chunk = BatchShape(((more_tokens, 0), *batch.prefill_chunks), batch.decode_contexts)
    assert model.step_s(one_more_decode) >= base
    assert model.step_s(longer_contexts) >= base
    assert model.step_s(longer_chunk) >= base


# --- constants ---------------------------------------------------------------------------------

def test_a_constants_file_overrides_a_constant(tmp_path):
    slower = tmp_path / "slower.yaml"
    slower.write_text("step_overhead_s: 0.010\n")
    assert load_constants(slower).step_overhead_s == 0.010
    assert load_constants(slower).mfu == Constants().mfu
    base, overridden = seventy_b(), seventy_b(constants_file=str(slower))
    assert overridden.decode_step_s(1, 2048) == pytest.approx(
        base.decode_step_s(1, 2048) + 0.010 - Constants().step_overhead_s)


def test_a_bad_constants_file_is_refused_by_name(tmp_path):
    typo = tmp_path / "typo.json"
    typo.write_text('{"mfuu": 0.4}')
    with pytest.raises(ValueError, match="unknown constant.*mfuu"):
        load_constants(typo)
    done = cli("--constants", str(typo))
    assert done.returncode == 2 and "mfuu" in done.stderr and "Traceback" not in done.stderr


# --- the command -----------------------------------------------------------------------------

def test_check_lands_every_published_point_within_15_percent():
    done = cli("--check")
    assert done.returncode == 0, done.stdout + done.stderr
    for source in ("NIM", "vLLM CI", "TensorRT-LLM"):
        assert source in done.stdout


def test_check_fails_when_the_constants_are_off(tmp_path):
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("mbu: 0.3\nmfu: 0.2\n")
    done = cli("--check", "--constants", str(wrong))
    assert done.returncode == 1 and "OVER" in done.stdout


def test_json_has_the_figures_by_length_batch_and_context():
    done = cli("--json", "--workload", "mixed", "--unscaled")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kv_bytes_per_token"] == 163_840
    assert report["weights_bytes"] / GB == pytest.approx(72.7, abs=0.1)
    assert report["kv_tokens_per_replica"] > 2e6
    assert set(report["prefill_s"]) >= {"200", "8192", "32768"}
    assert report["decode_step_s"]["64"]["2048"] > 0
    assert report["decode_step_s"]["256"]["32768"] is None          # 8M tokens of KV do not fit
    assert report["transfer_s"]["32768"] > report["transfer_s"]["200"]
    workload = report["workload"]
    assert workload["prefill_replica_s_per_s"] > 0 and workload["decode_replica_s_per_s"] > 0
    assert workload["prefill_to_decode"] == pytest.approx(
        workload["prefill_replica_s_per_s"] / workload["decode_replica_s_per_s"])


def test_a_target_that_cannot_hold_its_weights_is_one_line_and_exit_2():
    done = cli("--gpu", "h100", "--tp", "1", "--dtype", "bf16")
    assert done.returncode == 2 and "does not fit" in done.stderr and "Traceback" not in done.stderr


def test_a_checkpoint_directory_gives_its_shape(tiny_model_dir):
    done = cli("--model", str(tiny_model_dir), "--tp", "1", "--dtype", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    # the tiny model: 4 layers, 2 KV heads of 256 / 8 = 32 dims
    assert json.loads(done.stdout)["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 2
