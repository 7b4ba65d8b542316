"""The processor's text handling, with the tiny LLaVA's tokenizer and no model: the
detokenizer, and the Complete and Chat handlers on a pipeline that replays token ids."""

import asyncio
import re
from typing import Any

import grpc
import pytest

from prism.devtools.tiny_models import llava_tokenizer
from prism.engine.detokenize import Detokenizer
from prism.engine.sampling import to_vllm
from prism.media.embeds import Geometry
from prism.media.fetch import MediaLoader
from prism.media.policy import MediaPolicy
from prism.modes import MODES
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import PrismError
from prism.services.processor.adapters import ServedModels
from prism.services.processor.inputs import ModelInputs
from prism.services.processor.servicer import InferenceServicer

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

        self.sampling: list[common_pb2.SamplingParams] = []

    async def run(self, request_id, prompt_ids, media, sampling, call, migration_limit=0,
                  adapter=None):  # fmt: skip
        self.requests.append((request_id, prompt_ids))
        self.media.append(media)
        self.sampling.append(sampling)
        usage = engine_pb2.PromptUsage(prompt_tokens=len(prompt_ids), cached_tokens=1)
        if sampling.HasField("prompt_logprobs"):
            usage.prompt_logprobs.extend(
                _scores(t, sampling.prompt_logprobs) for t in prompt_ids[1:]
            )
        for index, token in enumerate(self.answer):
            reply = engine_pb2.GenerateResponse(token_ids=[token])
            if index == 0:
                reply.first.CopyFrom(usage)
            if sampling.HasField("logprobs"):
                reply.logprobs.append(_scores(token, sampling.logprobs))
            yield reply
        yield engine_pb2.GenerateResponse(last=engine_pb2.Finish(reason=LENGTH))


def _scores(token: int, top: int) -> engine_pb2.EngineLogprobs:
    """Made-up logprobs for `token`, drawn at rank 2 behind token 100, as the engine lays
    them out: the token, then the top ones."""
    ranked = [(100, -0.25), (token, -1.5), (101, -3.0)][:top]
    return engine_pb2.EngineLogprobs(
        token_ids=[token, *(t for t, _ in ranked)],
        logprobs=[-1.5, *(lp for _, lp in ranked)],
        rank=2,
    )


async def handle(
    tokenizer, answer: str, *calls, max_model_len: int = 64, **servicer: Any
) -> tuple[list, Replay]:
    """Each call (handlers → request's replies) made on a processor whose worker answers
    `answer` and which `servicer` sets up further (inputs, parsers): its replies, or the
    error it raised."""
    pipeline = Replay(tokenizer.encode(answer, add_special_tokens=False))
    loader = MediaLoader(MediaPolicy())
    handlers = InferenceServicer(
        tokenizer, ServedModels("tiny", "tiny", {}), pipeline, loader,
        max_model_len=max_model_len, **servicer,
    )  # fmt: skip
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


def test_n_choices_run_apart_with_seeds_as_vllm_gives_them(tokenizer):
    sampling = common_pb2.SamplingParams(n=3, seed=7)
    request = inference_pb2.CompleteRequest(text="The cat", request_id="c1", sampling=sampling)
    (replies,), pipeline = asyncio.run(
        handle(tokenizer, "A red square.", lambda h: h.complete(request))
    )
    assert sorted(r[0] for r in pipeline.requests) == ["0_c1", "1_c1", "2_c1"]
    assert sorted(s.seed for s in pipeline.sampling) == [7, 8, 9]
    assert {s.n for s in pipeline.sampling} == {1}
    for index in range(3):
        text = "".join(r.text for r in replies if r.index == index)
        assert text == "A red square."
    assert [r.finish_reason for r in replies].count(LENGTH) == 3
    # Usage counts every choice; the stream's last message has the totals.
    assert replies[-1].usage.completion_tokens == 3 * len(pipeline.answer)
    assert replies[-1].usage.prompt_tokens == len(tokenizer.encode("The cat"))


def test_logprobs_are_decoded_per_token_and_echo_starts_with_the_prompt(tokenizer):
    sampling = common_pb2.SamplingParams(logprobs=2)
    request = inference_pb2.CompleteRequest(
        text="The cat", request_id="c1", sampling=sampling, echo=True
    )
    (replies,), pipeline = asyncio.run(
        handle(tokenizer, "A red square.", lambda h: h.complete(request))
    )
    prompt = tokenizer.encode("The cat")
    # As vLLM: echo with logprobs asks for the prompt's too.
    assert pipeline.sampling[0].prompt_logprobs == 2
    assert replies[0].text.startswith("The cat")
    assert list(replies[0].token_ids[: len(prompt)]) == prompt
    positions = [p for r in replies for p in r.logprobs]
    assert len(positions) == len(prompt) + len(pipeline.answer)
    assert positions[0].token.rank == 0 and not positions[0].top
    expected = [*prompt, *pipeline.answer]
    assert [p.token.token_id for p in positions] == expected
    for position in positions[1:]:
        assert position.token.rank == 2 and position.token.logprob == -1.5
        assert [t.token_id for t in position.top] == [100, position.token.token_id]
        assert [t.rank for t in position.top] == [1, 2]
    text = "".join(p.token.token for p in positions[len(prompt) :])
    assert text == "A red square."
    assert [p.token.token_id for p in replies[0].prompt_logprobs] == prompt


def test_a_constraint_that_cannot_compile_fails_before_any_work(tokenizer):
    bad = common_pb2.StructuredOutput(json_schema='{"type": "nonsense"}')
    request = inference_pb2.CompleteRequest(
        text="x", sampling=common_pb2.SamplingParams(structured_output=bad)
    )
    (error,), pipeline = asyncio.run(handle(tokenizer, "a", lambda h: h.complete(request)))
    assert isinstance(error, PrismError) and error.param == "structured_output"
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert pipeline.requests == []


def test_chat_applies_the_template_and_bad_requests_fail_before_any_work(tokenizer):
    message = inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(text="Is it red?")]
    )
    too_long = inference_pb2.CompleteRequest(token_ids=inference_pb2.TokenIds(ids=[5] * 65))
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
    assert long_prompt.param == "input_tokens"


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


def test_a_completion_takes_images_for_the_placeholders_its_prompt_holds(tokenizer):
    from support.content import png

    inputs = ModelInputs(tokens={"image": tokenizer.convert_tokens_to_ids("<image>")})
    image = common_pb2.Image(data=png(1), mime_type="image/png")

    def complete(prompt: str, images: int):
        request = inference_pb2.CompleteRequest(text=prompt, images=[image] * images)
        return lambda h: h.complete(request)

    (replies, *errors), pipeline = asyncio.run(
        handle(
            tokenizer, "A red square.",
            complete("USER: <image>\nWhat is it? ASSISTANT:", 1),
            complete("USER: What is it? ASSISTANT:", 1),
            complete("USER: <image>\nWhat is it? ASSISTANT:", 2),
            inputs=inputs,
        )
    )  # fmt: skip
    assert "".join(r.text for r in replies) == "A red square."
    (media,) = pipeline.media
    assert [(i.width, i.height) for i in media.images] == [(64, 48)]
    for error, found in zip(errors, (0, 1), strict=True):
        assert isinstance(error, PrismError) and error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.param == "prompt" and f"'<image>' {found} times" in error.message

    (error,), pipeline = asyncio.run(
        handle(tokenizer, "No.", complete("<image> What?", 1), inputs=ModelInputs())
    )
    assert isinstance(error, PrismError) and "does not accept images" in error.message
    assert pipeline.requests == []


def test_the_model_is_listed_only_while_the_stages_behind_can_serve(tokenizer):
    async def listed(ready: bool) -> list[str]:
        loader = MediaLoader(MediaPolicy())
        handlers = InferenceServicer(
            tokenizer, ServedModels("tiny", "tiny", {}), Replay([]), loader, max_model_len=64
        )
        handlers.ready = ready
        reply = await handlers.list_models(inference_pb2.ListModelsRequest())
        await loader.close()
        return [model.id for model in reply.models]

    assert asyncio.run(listed(False)) == []
    assert asyncio.run(listed(True)) == ["tiny"]
