"""The processor's text handling, with the tiny LLaVA's tokenizer and no model: the
detokenizer, and the Complete and Chat handlers on a pipeline that replays token ids."""

import asyncio
import re

import grpc
import pytest

from prism.embeds import Geometry
from prism.media import MediaLoader, MediaPolicy
from prism.modes import MODES
from prism.rpc import PrismError
from prism.sampling import to_vllm
from prism.services.processor import InferenceServicer
from prism.services.processor.detokenize import Detokenizer
from prism.services.processor.inputs import ModelInputs
from prism.stage.v1 import engine_pb2
from prism.tiny_models import llava_tokenizer
from prism.v1 import common_pb2, inference_pb2

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tokenizer():
    return llava_tokenizer()


def test_deltas_add_up_to_the_decoded_answer(tokenizer):
    ids = tokenizer.encode("The cat sat on the mat. A red square.", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, "r", [1, 2], to_vllm(common_pb2.SamplingParams()))
    deltas = [detokenizer.update([i], 0) for i in ids[:-1]]
    deltas.append(detokenizer.update(ids[-1:], LENGTH))
    assert "".join(d.text for d in deltas) == "The cat sat on the mat. A red square."
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [d.finished for d in deltas] == [False] * (len(ids) - 1) + [True]
    assert deltas[-1].finish_reason == LENGTH and detokenizer.sent == len(ids)


def test_a_stop_string_ends_the_answer_before_it(tokenizer):
    ids = tokenizer.encode("The cat sat on the mat. A red square.", add_special_tokens=False)
    sampling = common_pb2.SamplingParams(stop=["the mat"])
    detokenizer = Detokenizer(tokenizer, "r", [1, 2], to_vllm(sampling))
    deltas = []
    for i in ids:
        deltas.append(detokenizer.update([i], 0))
        if deltas[-1].finished:
            break
    assert "".join(d.text for d in deltas) == "The cat sat on "
    assert deltas[-1].finish_reason == STOP
    # The tokens after the stop string's start are never handed out.
    assert detokenizer.sent < len(ids)


class Replay:
    """A pipeline whose worker answers with `answer`'s token ids, one per reply."""

    mode = MODES["epd"]

    def __init__(self, answer: list[int]):
        self.answer = answer
        self.requests: list[tuple[str, list[int]]] = []
        self.media: list = []

    async def run(self, request_id, prompt_ids, media, sampling, call, migration_limit=0):
        self.requests.append((request_id, prompt_ids))
        self.media.append(media)
        usage = engine_pb2.PromptUsage(prompt_tokens=len(prompt_ids), cached_tokens=1)
        yield engine_pb2.GenerateResponse(token_ids=self.answer[:1], first=usage)
        for token in self.answer[1:]:
            yield engine_pb2.GenerateResponse(token_ids=[token])
        yield engine_pb2.GenerateResponse(last=engine_pb2.Finish(reason=LENGTH))


async def handle(
    tokenizer, answer: str, *calls, inputs: ModelInputs | None = None
) -> tuple[list, Replay]:
    """Each call (handlers → request's replies) made on a processor whose worker answers
    `answer` and whose model takes `inputs`: its replies, or the error it raised."""
    pipeline = Replay(tokenizer.encode(answer, add_special_tokens=False))
    loader = MediaLoader(MediaPolicy())
    handlers = InferenceServicer(
        tokenizer, "tiny", pipeline, loader, max_model_len=64, inputs=inputs
    )
    results = []
    try:
        for call in calls:
            try:
                results.append([reply async for reply in call(handlers)])
            except PrismError as exc:
                results.append(exc)
    finally:
        await loader.close()
    return results, pipeline


def test_complete_answers_text_and_usage(tokenizer):
    request = inference_pb2.CompleteRequest(text="The cat", request_id="c1")
    (replies,), pipeline = asyncio.run(
        handle(tokenizer, "A red square.", lambda h: h.complete(request))
    )
    assert "".join(r.text for r in replies) == "A red square."
    assert {r.request_id for r in replies} == {"c1"} and replies[-1].finish_reason == LENGTH
    prompt = tokenizer.encode("The cat")
    assert pipeline.requests == [("c1", prompt)]
    usage = replies[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(pipeline.answer))
    assert usage.total_tokens == len(prompt) + len(pipeline.answer)
    assert usage.cached_tokens == 1


def test_chat_applies_the_template_and_bad_requests_fail_before_any_work(tokenizer):
    message = inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(text="Is it red?")]
    )
    too_long = inference_pb2.CompleteRequest(token_ids=inference_pb2.TokenIds(ids=[5] * 64))
    results, pipeline = asyncio.run(
        handle(
            tokenizer,
            "Yes.",
            lambda h: h.chat(inference_pb2.ChatRequest(messages=[message])),
            lambda h: h.chat(inference_pb2.ChatRequest()),
            lambda h: h.chat(inference_pb2.ChatRequest(messages=[message], model="other")),
            lambda h: h.complete(too_long),
        )
    )
    replies, empty, other_model, long_prompt = results
    assert "".join(r.text for r in replies) == "Yes."
    ((_, prompt),) = pipeline.requests
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Is it red?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "Is it red?" in templated
    assert prompt == tokenizer.encode(templated, add_special_tokens=False)
    assert (empty.param, other_model.param) == ("messages", "model")
    assert other_model.code == grpc.StatusCode.NOT_FOUND
    assert long_prompt.code == grpc.StatusCode.INVALID_ARGUMENT and "context" in long_prompt.message


def _chat(*parts: inference_pb2.ContentPart) -> inference_pb2.ChatRequest:
    text = inference_pb2.ContentPart(text="What is it?")
    message = inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=[*parts, text])
    return inference_pb2.ChatRequest(messages=[message])


def _embedding(tokens: int = 4, hidden: int = 8) -> inference_pb2.ContentPart:
    data = bytes(tokens * hidden * 4)
    embedding = common_pb2.ImageEmbedding(dtype="float32", shape=[tokens, hidden], data=data)
    return inference_pb2.ContentPart(image_embedding=embedding)


def test_media_the_model_or_server_does_not_take_is_refused_before_any_work(tokenizer):
    video = inference_pb2.ContentPart(video=common_pb2.Video(url="http://127.0.0.1/v.mp4"))
    image = inference_pb2.ContentPart(image=common_pb2.Image(url="http://127.0.0.1/i.png"))
    takes_embeddings = ModelInputs(embeddings=Geometry(8, 4), embeddings_enabled=True)
    cases = [
        (ModelInputs(), _chat(video), "does not accept video", "content[0].video_url"),
        (ModelInputs(), _chat(_embedding()), "--enable-mm-embeds", "content[0].image_embeds"),
        (takes_embeddings, _chat(_embedding(5)), r"shape \[4, 8\]", "content[0].image_embeds"),
        (takes_embeddings, _chat(image, _embedding()), "cannot mix", "messages"),
    ]
    for inputs, request, message, param in cases:
        (error,), pipeline = asyncio.run(
            handle(tokenizer, "No.", lambda h, r=request: h.chat(r), inputs=inputs)
        )
        assert isinstance(error, PrismError) and error.http_status == 400, message
        assert re.search(message, error.message) and error.param.endswith(param), error
        assert pipeline.requests == []


def test_client_embeddings_reach_the_pipeline_as_inline_handles(tokenizer):
    inputs = ModelInputs(embeddings=Geometry(8, 4), embeddings_enabled=True)
    (replies,), pipeline = asyncio.run(
        handle(
            tokenizer, "Yes.", lambda h: h.chat(_chat(_embedding(), _embedding())), inputs=inputs
        )
    )
    assert "".join(r.text for r in replies) == "Yes."
    (media,) = pipeline.media
    assert [h.embeddings.WhichOneof("location") for h in media.image_embeddings] == [
        "inline_data",
        "inline_data",
    ]
    assert not media.images and not media.videos
