"""End to end: Qwen2.5-VL, whose vision tower attends within windows and whose video tokens
are placed in time, answers in every mode exactly as one offline vLLM engine does.

Its own tiny model, oracle and meshes, one mesh at a time: the session's families
(support.cases.FAMILIES) do not include it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from support.cases import CASES, VIDEO_CASES, ask_case, openai_client, run_oracle
from support.content import data_url, image_part, png, user, video, video_part
from support.meshes import start_mesh
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists

from prism.devtools.tiny_models import build

FAMILY = "qwen2.5-vl"
MODES = ("e/pd", "e/p/d", "ep/d", "epd")
OWN_CASES = {
    # 112 px square: 4x4 merged tokens, so four 2x2 attention windows; the other cases'
    # images fit in one.
    "windowed_image": (
        "chat",
        user(image_part(data_url(png(7, (112, 112)))), "What is in this image?"),
        16,
    ),
    # Half a second: vLLM samples 4 of its 16 frames (8 per second), so M-RoPE spaces its
    # two temporal patches 2/8 s apart, where the other videos' sampling gives the default
    # of 1 s: the encoder's embeddings, and decode's layout of prefill's media, must carry
    # the spacing.
    "short_video": (
        "chat",
        user(video_part(data_url(video(36, fps=32.0), "video/mp4")), "What happens?"),
        16,
    ),
}
ALL_CASES = CASES | VIDEO_CASES | OWN_CASES


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(FAMILY, tmp_path_factory.mktemp("models") / FAMILY, seed=0)


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_oracle(model, tmp_path_factory.mktemp("o-qwen2.5-vl"), ALL_CASES)


@pytest.fixture(scope="module", params=MODES, ids=[m.replace("/", "-") for m in MODES])
def qwen_mesh(request, model, expected, tmp_path_factory):
    # `expected` first: the oracle's engine is gone before the mesh's start.
    running = start_mesh(FAMILY, request.param, model, tmp_path_factory.mktemp("logs"))
    yield running
    running.stop()


def test_images_and_videos_change_the_answer(expected):
    # Guards the parity tests against a model that ignores what it sees.
    answers = [expected[case]["token_ids"] for case in ALL_CASES if case != "completion"]
    assert len({tuple(tokens) for tokens in answers}) == len(answers)


def reported(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> list[str]:
    """Generated `token_ids` as vLLM's logprobs name them: one token at a time, in the
    context of those before it (a byte that ends no character reads "")."""
    params = SimpleNamespace(sampling_params=SamplingParams(logprobs=0))
    logprobs = LogprobsProcessor.from_new_request(tokenizer, params)
    for token in token_ids:
        lists = LogprobsLists(np.array([[token]]), np.array([[0.0]], np.float32), np.array([1]))
        logprobs.update_from_output(
            EngineCoreOutput(request_id="", new_token_ids=[], new_logprobs=lists)
        )
    assert logprobs.logprobs is not None
    return [
        position[token].decoded_token or ""
        for position, token in zip(logprobs.logprobs, token_ids, strict=True)
    ]


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_matches_offline_vllm_token_for_token(qwen_mesh, expected, case):
    kind, body, max_tokens = ALL_CASES[case]
    want = expected[case]
    client = openai_client(qwen_mesh)
    if kind == "chat":
        reply = client.chat.completions.create(model=qwen_mesh.model, messages=body,
                                               temperature=0, max_tokens=max_tokens,
                                               logprobs=True)  # fmt: skip
        text = reply.choices[0].message.content
        tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    else:
        reply = client.completions.create(model=qwen_mesh.model, prompt=body, temperature=0,
                                          max_tokens=max_tokens, logprobs=0)  # fmt: skip
        text, tokens = reply.choices[0].text, reply.choices[0].logprobs.tokens
    tokenizer = AutoTokenizer.from_pretrained(qwen_mesh.model)
    assert tokens == reported(tokenizer, want["token_ids"])
    assert text == want["text"]
    assert reply.usage.prompt_tokens == want["prompt_tokens"]


@pytest.mark.parametrize("case", ["three_images", "image_and_video", "windowed_image"])
def test_streams_the_same_answer(qwen_mesh, expected, case):
    text, usage = ask_case(qwen_mesh, ALL_CASES[case], stream=True)
    assert text == expected[case]["text"]
    assert usage.completion_tokens == len(expected[case]["token_ids"])
    assert usage.prompt_tokens == expected[case]["prompt_tokens"]
