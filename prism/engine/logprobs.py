"""The engines' log probabilities as the public API gives them: each token decoded by
vLLM's own logprobs processor, so that tokens read exactly as `vllm serve` reports them
(byte-fallback pieces included). The worker sends only ids and numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists

from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2


@dataclass
class _LogprobsRequest:
    """The field of vLLM's EngineCoreRequest that its logprobs processor reads."""

    sampling_params: SamplingParams


def _arrays(position: engine_pb2.EngineLogprobs) -> tuple[np.ndarray, ...]:
    """(token ids, logprobs, ranks) of one position as vLLM's engine core hands them on;
    one at a time, since positions may list different numbers of tokens."""
    return (
        np.array([list(position.token_ids)], dtype=np.int64),
        np.array([list(position.logprobs)], dtype=np.float32),
        np.array([position.rank], dtype=np.int64),
    )


class Logprobs:
    """One choice's log probabilities, position by position."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._inner = LogprobsProcessor.from_new_request(tokenizer, _LogprobsRequest(params))

    def output(
        self, positions: Sequence[engine_pb2.EngineLogprobs]
    ) -> list[common_pb2.PositionLogprobs]:
        """The public form of the next generated positions."""
        if self._inner.logprobs is None or not positions:
            return []
        done = len(self._inner.logprobs)
        for position in positions:
            lists = LogprobsLists(*_arrays(position))
            self._inner.update_from_output(
                EngineCoreOutput(request_id="", new_token_ids=[], new_logprobs=lists)
            )
        return [
            _position(position, decoded)
            for position, decoded in zip(positions, self._inner.logprobs[done:], strict=True)
        ]

    def prompt(
        self, prompt_ids: Sequence[int], positions: Sequence[engine_pb2.EngineLogprobs]
    ) -> list[common_pb2.PositionLogprobs]:
        """The public form of the prompt's positions: the first unscored, as vLLM has it."""
        if self._inner.prompt_logprobs is None or not positions:
            return []
        for position in positions:
            self._inner.update_from_output(
                EngineCoreOutput(
                    request_id="", new_token_ids=[], new_prompt_logprobs_tensors=_arrays(position)
                )
            )
        decoded = self._inner.pop_prompt_logprobs() or []
        first = common_pb2.TokenLogprob(
            token_id=prompt_ids[0], token=self.tokenizer.decode(prompt_ids[0])
        )
        scored = [
            _position(position, tokens)
            for position, tokens in zip(positions, decoded[1:], strict=True)
        ]
        return [common_pb2.PositionLogprobs(token=first), *scored]


def _position(position: engine_pb2.EngineLogprobs, decoded: dict) -> common_pb2.PositionLogprobs:
    def token(index: int, rank: int) -> common_pb2.TokenLogprob:
        token_id = position.token_ids[index]
        return common_pb2.TokenLogprob(
            token_id=token_id,
            token=decoded[token_id].decoded_token or "",
            logprob=position.logprobs[index],
            rank=rank,
        )

    return common_pb2.PositionLogprobs(
        token=token(0, position.rank),
        top=[token(i, i) for i in range(1, len(position.token_ids))],
    )
