"""SmolLM2-135M-Instruct, a real instruct model, computed by kvfleet as by two references.

The random checkpoints of test_runner.py check the arithmetic; a trained model checks what they
cannot: real weight scales (its Q4_1 GGUF, dequantized), 30 layers of accumulated rounding, a 49K
vocabulary, tied embeddings, rope_theta 1e5 without scaling, and prompts made by its own chat
template. Everything runs in float32 on CPU, in the checkpoint `kvfleet make-model` writes.

1. transformers (LlamaForCausalLM from the same directory, float32) is the reference for logits.
   Three chat prompts go through the ModelRunner at different stages, so that two steps hold
   decode rows and prefill chunks side by side, then a few all-decode steps follow; each decode
   feeds back kvfleet's own argmax. Every logit row kvfleet
   returns matches transformers' log_softmax at that position within 1e-4, the tolerance of the
   tiny models' tests, and kvfleet's greedy tokens are transformers' argmax.
2. vLLM (CPU build, float32) is the reference for served output. Its greedy ids for three chat
   prompts were recorded once by `loadtests/check_vllm_loads_tiny.py --chat ... --record`
   (data/smollm2_vllm_greedy.json; command and versions in docs/vllm-check.md). kvfleet's chat
   encoding gives the same prompt ids, and kvfleet's LLMEngine, serving the three at once with
   chunked prefill, reproduces every one of vLLM's ids (48 per prompt, past the answer's
   <|im_end|>: vLLM ran with ignore_eos) and its text, with logprobs within 1e-3.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.engine import LLMEngine, engine_config
from services.engine.model import KVCache, ModelRunner, SeqChunk, load_model
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from tests.engine.model.helpers import Seq, ShuffledBlockIds, load_reference, reference_logprobs

BLOCK = 16
TOLERANCE = 1e-4        # max |log_softmax(kvfleet) - log_softmax(transformers)|, as test_runner.py
NEAR_TIE = 1e-4         # an argmax is only compared where the top-2 logit gap is wider
VLLM_LOGPROB_TOL = 1e-3  # chosen-token logprobs vs vLLM's (its own kernels), as the check script
VLLM_GREEDY = Path(__file__).parent / "data" / "smollm2_vllm_greedy.json"

QUESTIONS = ["What is the capital of France?",
             "Write a haiku about the sea.",
             "Give me three tips for staying focused while studying."]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A step here is a few rows through 135M weights: on a shared 2-core box one thread beats
    two spinning on each other (a 3-row decode step: 0.5 s against 1.3-3.5 s under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def chat_prompts(tok):
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    return load_reference(smollm2_dir)


def test_prefill_chunks_and_decode_rows_in_one_batch_match_transformers(smollm2_dir, hf,
                                                                         chat_prompts):
    model = load_model(smollm2_dir, dtype="float32")
    runner = ModelRunner(model, KVCache(model.config, 64, BLOCK, torch.float32))
    pool = ShuffledBlockIds(64, seed=0)
    a, b, c = seqs = [Seq(list(p), pool, BLOCK) for p in chat_prompts]
    rows: list[tuple[int, int, torch.Tensor]] = []    # (sequence, position, kvfleet's logits)

    def step(*chunks: tuple[Seq, SeqChunk]) -> torch.Tensor:
        """One runner step. Every row it returns is kept; a sequence whose step reached its end
        (a decode, or the last chunk of its prompt) appends kvfleet's argmax as its next token."""
        logits = runner.execute([chunk for _, chunk in chunks])
        sizes = [len(chunk.logit_rows) for _, chunk in chunks]
        for (seq, chunk), out in zip(chunks, logits.split(sizes)):
            rows.extend((seqs.index(seq), chunk.start_pos + r, row)
                        for r, row in zip(chunk.logit_rows, out))
            if seq.computed == len(seq.tokens):
                seq.tokens.append(out[-1].argmax().item())
        return logits

    # a prefills its whole prompt (sampling its last row); b its first 16 tokens
    step((a, a.chunk(len(a.tokens), "last")), (b, b.chunk(16)))
    # the mixed step: a decodes | b prefills the rest of its prompt | c starts its prompt
    mixed = step((a, a.chunk(1)), (b, b.chunk(len(b.tokens) - 16)), (c, c.chunk(20)))
    assert mixed.shape == (1 + len(chat_prompts[1]) - 16 + 20, model.config.vocab_size)
    # a and b decode while c prefills the rest of its prompt; then five all-decode steps
    step((a, a.chunk(1)), (b, b.chunk(1)), (c, c.chunk(len(c.tokens) - 20)))
    for _ in range(5):
        step(*((s, s.chunk(1)) for s in seqs))
    assert [len(s.tokens) - len(p) for s, p in zip(seqs, chat_prompts)] == [8, 7, 6]

    references = [reference_logprobs(hf, s.tokens) for s in seqs]    # [len(tokens), vocab] each
    # a: 8 sampled rows; b and c: a row per prompt token, then 6 and 5 decode rows
    assert len(rows) == 8 + len(chat_prompts[1]) + 6 + len(chat_prompts[2]) + 5
    for i, pos, logits in rows:
        diff = (logits.log_softmax(-1) - references[i][pos]).abs().max().item()
        assert diff <= TOLERANCE, (QUESTIONS[i], pos, diff)

    for i, (seq, prompt) in enumerate(zip(seqs, chat_prompts)):   # the greedy answers agree
        for pos in range(len(prompt) - 1, len(seq.tokens) - 1):
            top2 = references[i][pos].topk(2).values
            if (top2[0] - top2[1]).item() >= NEAR_TIE:
                assert seq.tokens[pos + 1] == references[i][pos].argmax().item(), (i, pos)


def test_the_engine_reproduces_vllms_greedy_tokens(smollm2_dir, tok):
    recorded = json.loads(VLLM_GREEDY.read_text())
    cases = recorded["cases"]
    assert recorded["dtype"] == "float32" and recorded["ignore_eos"] and len(cases) >= 3
    for case in cases:                                  # the prompt vLLM rendered is kvfleet's too
        assert tok.encode_chat(case["messages"]) == case["prompt_token_ids"]

    engine = LLMEngine(engine_config(str(smollm2_dir), dtype="float32", token_budget=32,
                                     chunk_size=16, max_running=8, kv_cache_mib=64))
    params = SamplingParams(max_tokens=recorded["max_tokens"], temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outs = engine.generate([case["prompt_token_ids"] for case in cases], params)

    for case, out in zip(cases, outs):
        assert out.token_ids == case["vllm_token_ids"]
        assert out.text == case["vllm_text"]
        diffs = [abs(lp.logprob - v) for lp, v in zip(out.logprobs, case["vllm_logprobs"])]
        assert len(diffs) == len(out.token_ids) and max(diffs) <= VLLM_LOGPROB_TOL
