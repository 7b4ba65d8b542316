"""Token ids to text deltas with vLLM's own incremental detokenizer, so that text and
stop strings match plain vLLM exactly. The tokenizer is given, not loaded here."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from vllm import SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from prism.proto.v1 import common_pb2


@dataclass
class _DetokenizerRequest:
    """The fields of vLLM's EngineCoreRequest that its detokenizer reads."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt_embeds: None = None


@dataclass
class Delta:
    """What one batch of tokens adds to the answer; `finish_reason` on the last."""

    text: str
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # The stop string that ended the answer, if one did.
    stop_sequence: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


class Detokenizer:
    """One request's text so far. A stop string ends the answer where it matches."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._inner = IncrementalDetokenizer.from_new_request(
            tokenizer, _DetokenizerRequest(request_id, prompt_ids, params)
        )
        # Output tokens handed out so far (a stop string may hold some back).
        self.sent = 0

    def update(self, token_ids: list[int], finish_reason: int) -> Delta:
        """The delta that `token_ids`, ending with `finish_reason` from the engine (or
        none yet), add."""
        stopped = finish_reason == common_pb2.FINISH_REASON_STOP
        stop_sequence = self._inner.update(token_ids, stopped) or ""
        if stop_sequence:
            finish_reason = common_pb2.FINISH_REASON_STOP
        finished = finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        text = self._inner.get_next_output_text(finished, delta=True)
        new = list(self._inner.output_token_ids[self.sent :])
        self.sent += len(new)
        return Delta(text, new, finish_reason, stop_sequence)
