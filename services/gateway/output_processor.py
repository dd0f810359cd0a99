"""The fleet's text is made here, once, in the gateway (as vLLM v1's front end OutputProcessor makes
it): the workers stream token ids and logprobs only, and for each sample of a request this keeps a
SampleText (services/engine/detokenizer.py: the incremental detokenizer, the stop strings, how much
text is final) and fills each chunk's `text`.

    worker chunk (ids, logprobs) -> process() -> chunk with its text, maybe cut at a stop string

A stop string ends its sample here: the chunk is cut after the token that completed it, and it
carries finish_reason "stop" with the stop string as its stop_reason. Once every sample has ended
here the chunk is the request's last (`finished`), and if the fleet had not ended the request the
caller ends it on the workers (a Cancel through the run's cancel path, which frees the decode
reservation and the KV; core.Session). With n > 1, a sample stopped here while others run is
ended alone on its worker (a Cancel with its sample_index: its KV is freed, the others go on);
what the workers sent of it before that lands is dropped here.

The EOS / stop token id that ended a sample (a worker's finish_reason "stop": workers match no
stop strings) has its text left out unless include_stop_str_in_output, as in vLLM. Bytes that
never complete a character at the end are left out (no U+FFFD). A model without a tokenizer gets
token ids only (no text, no stop strings), as before.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.engine.detokenizer import SampleText
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.protocol.params import params_from_pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb


class _Sample:
    def __init__(self, text: SampleText | None) -> None:
        self.text = text
        self.num_tokens = 0          # output tokens seen (kept) for this sample
        self.ended = False           # its finish_reason has been passed on


class OutputProcessor:
    """One request's text: `process` each chunk the fleet sends, in order."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int],
                 params: pb.SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._prompt_ids = prompt_ids
        self._params: SamplingParams = params_from_pb(params)
        self._samples: dict[int, _Sample] = {}

    @property
    def ended(self) -> bool:
        """Every sample has ended (by the fleet's finish or a stop string matched here)."""
        samples = self._samples.values()
        return len(self._samples) == self._params.n and all(s.ended for s in samples)

    def process(self, chunk: pb.TokenChunk) -> pb.TokenChunk | None:
        """`chunk` with its text filled in (and cut at a stop string), changed in place; None for
        a chunk of a sample already stopped here (it carries nothing the client may see)."""
        sample = self._sample(chunk.index)
        if sample.ended:
            return None
        self._push(sample, chunk)
        sample.ended = bool(chunk.finish_reason)
        chunk.text = sample.text.take(sample.ended) if sample.text is not None else ""
        chunk.finished = chunk.finished or self.ended
        return chunk

    def _push(self, sample: _Sample, chunk: pb.TokenChunk) -> None:
        """Detokenize the chunk's tokens one by one; at a stop string, cut the chunk there."""
        ids = list(chunk.token_ids)
        # the stop token that ended the sample at a worker: counted, its text left out
        last_silent = chunk.finish_reason == "stop" and not self._params.include_stop_str_in_output
        for j, token in enumerate(ids):
            sample.num_tokens += 1
            if sample.text is None or (last_silent and j == len(ids) - 1):
                continue
            stop = sample.text.push(token, sample.num_tokens)
            if stop is not None:
                _cut(chunk, j + 1, stop, sample.num_tokens)
                return

    def _sample(self, index: int) -> _Sample:
        sample = self._samples.get(index)
        if sample is None:
            text = (SampleText.for_params(self._tokenizer.raw, self._prompt_ids, self._params)
                    if self._tokenizer is not None else None)
            sample = self._samples[index] = _Sample(text)
        return sample


def _cut(chunk: pb.TokenChunk, keep: int, stop: str, num_output_tokens: int) -> None:
    """End the chunk's sample after its first `keep` tokens, on the stop string `stop`."""
    del chunk.token_ids[keep:]
    del chunk.logprobs[keep:]
    chunk.finish_reason, chunk.stop_reason = "stop", stop
    chunk.num_output_tokens = num_output_tokens
