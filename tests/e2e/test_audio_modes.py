"""End to end: audio, as OpenAI's `input_audio` and as `audio_url`, through the official
`openai` SDK in every mode, answered exactly as one offline vLLM engine answers; and audio
the mesh refuses, with the mesh serving on.

Its own tiny Qwen2-Audio, oracle and meshes, one mesh at a time. In E/PD and E/P/D the
encoder runs the audio tower and the worker (or prefill) reads the clips' embeddings; in
EPD and EP/D the worker (or prefill) hears the clip itself.
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import openai
import pytest
import soundfile
from support.cases import ask_case, openai_client, run_oracle
from support.content import audio, audio_part, data_url, input_audio_part, user
from support.meshes import start_mesh

from prism.devtools.tiny_models import build
from prism.media.audio import AudioDecoder
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.rpc.channel import sync_channel

FAMILY = "qwen2-audio"
MODES = ("epd", "e/pd", "e/p/d", "ep/d")
CASES = {
    "input_audio": ("chat", user(input_audio_part(audio(1)), "What is said?"), 12),
    "audio_url_flac": (
        "chat",
        user(audio_part(data_url(audio(2, fmt="FLAC"), "audio/flac")), "And here?"),
        12,
    ),
    # Two clips in one message, in order, of different lengths (so different token counts).
    "two_clips": (
        "chat",
        user(
            input_audio_part(audio(3, seconds=0.5)),
            "then",
            audio_part(data_url(audio(4, seconds=1.5), "audio/wav")),
        ),
        12,
    ),
    "text": ("chat", user("Just text, please."), 12),
    # At 44.1 kHz: the worker resamples it to the model's 16 kHz (vLLM's resampler).
    "resampled": ("chat", user(input_audio_part(audio(7, rate=44100)), "Resampled?"), 12),
}
CLIPS = 5


def resampled_by_hand() -> dict[str, tuple]:
    """The oracle's form of the "resampled" case: the clip resampled as a worker resamples
    it, written exactly (32-bit float WAV); the vLLM here has no resampler of its own
    (torchaudio has no build for its CPU torch)."""
    samples, rate = AudioDecoder(16000).decode(audio(7, rate=44100))
    out = io.BytesIO()
    soundfile.write(out, samples, int(rate), format="WAV", subtype="FLOAT")
    return {"resampled": ("chat", user(input_audio_part(out.getvalue()), "Resampled?"), 12)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(FAMILY, tmp_path_factory.mktemp("models") / FAMILY, seed=0)


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_oracle(model, tmp_path_factory.mktemp("o-qwen2-audio"), CASES | resampled_by_hand())


@pytest.fixture(scope="module", params=MODES, ids=[m.replace("/", "-") for m in MODES])
def audio_mesh(request, model, expected, tmp_path_factory):
    # `expected` first: the oracle's engine is gone before the mesh's start.
    logs = tmp_path_factory.mktemp("logs")
    # E/P/D routes by KV: the prompt's block keys count each clip's tokens.
    routing = "kv" if request.param == "e/p/d" else "round-robin"
    running = start_mesh(FAMILY, request.param, model, logs, max_audio_seconds=30,
                         routing=routing)  # fmt: skip
    yield running
    running.stop()


def test_the_audio_changes_the_answer(expected):
    # Guards the parity test against a model that ignores what it hears.
    answers = [tuple(expected[case]["token_ids"]) for case in CASES]
    assert len(set(answers)) == len(answers)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_audio_answers_as_offline_vllm(audio_mesh, expected, stream):
    looked_up = encoder_lookups(audio_mesh)
    for name, case in CASES.items():
        text, usage = ask_case(audio_mesh, case, stream)
        assert text == expected[name]["text"], (name, audio_mesh.mode)
        assert usage.prompt_tokens == expected[name]["prompt_tokens"], name
    if audio_mesh.mode in ("e/pd", "e/p/d"):
        # Every clip was the encoder's (encoded, or met before and cached), none the
        # worker's for want of an encoder.
        assert encoder_lookups(audio_mesh) - looked_up == CLIPS
        assert audio_mesh.metric("front", "prism_encode_fallbacks_total") == 0


def encoder_lookups(mesh) -> float:
    if mesh.mode not in ("e/pd", "e/p/d"):
        return 0.0
    return sum(
        mesh.metric("encoder", f"prism_embedding_cache_{outcome}_total")
        for outcome in ("hits", "misses")
    )


def test_audio_over_the_public_grpc_api_answers_as_offline_vllm(audio_mesh, expected):
    """Two clips, as bytes and as a data URL, in a ChatRequest a gRPC client builds."""
    clips = [
        common_pb2.Audio(data=audio(3, seconds=0.5), mime_type="audio/wav"),
        common_pb2.Audio(url=data_url(audio(4, seconds=1.5), "audio/wav")),
    ]
    parts = [inference_pb2.ContentPart(audio=clips[0]), inference_pb2.ContentPart(text="then"),
             inference_pb2.ContentPart(audio=clips[1])]  # fmt: skip
    request = inference_pb2.ChatRequest(
        model=audio_mesh.model,
        messages=[inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=parts)],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=12),
    )
    stub = inference_pb2_grpc.InferenceServiceStub(sync_channel(audio_mesh.processor))
    replies = list(stub.Chat(request, timeout=120))
    assert "".join(reply.text for reply in replies) == expected["two_clips"]["text"]


def test_hostile_audio_gets_a_4xx_and_the_mesh_serves_on(audio_mesh, expected):
    client = openai_client(audio_mesh)
    whole = audio(5, seconds=2.0)
    hostile = {
        "cut short": (input_audio_part(whole[: len(whole) // 2]), 400, "cut short"),
        "not audio": (input_audio_part(b"this is no audio at all", "mp3"), 415, "not audio"),
        "too long": (input_audio_part(audio(6, seconds=40.0)), 400, "more than the limit"),
        "bad base64": ({"type": "input_audio", "input_audio": {"data": "%%", "format": "wav"}},
                       400, "not valid base64"),
        "private url": (audio_part("http://10.0.0.1/a.wav"), 400, "private address"),
    }  # fmt: skip
    for name, (part, status, message) in hostile.items():
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=audio_mesh.model, messages=user(part, "Hm?"), max_tokens=4
            )
        assert info.value.status_code == status, (name, info.value.message)
        assert message in info.value.message, (name, info.value.message)
    text, _ = ask_case(audio_mesh, CASES["input_audio"], stream=False)
    assert text == expected["input_audio"]["text"]


def test_with_the_encoder_killed_the_worker_hears_the_clips_and_answers_the_same(
    audio_mesh, expected
):
    """Encoding that never fails a request, for audio: with the mesh's encoder killed,
    the worker (or prefill) that would read the clips' embeddings runs the audio tower
    itself. Last in this module: the encoder is started again after."""
    if "encoder-0" not in {stage.name for stage in audio_mesh.mesh.stages}:
        pytest.skip("the worker hears the clips in this mode already")
    encoder = audio_mesh.mesh.stage("encoder-0")
    before = audio_mesh.metric("front", "prism_encode_fallbacks_total")
    os.killpg(encoder.process.pid, signal.SIGKILL)
    encoder.process.wait(timeout=30)
    try:
        for case in ("input_audio", "two_clips"):
            text, _ = ask_case(audio_mesh, CASES[case], stream=True)
            assert text == expected[case]["text"], case
        assert audio_mesh.metric("front", "prism_encode_fallbacks_total") == before + 2
    finally:
        with open(audio_mesh.log_path, "a") as log:
            audio_mesh.mesh.restart("encoder-0", log=log)
