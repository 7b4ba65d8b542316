"""End to end: videos through every mode, equal to one offline vLLM engine.

The Qwen2-VL family has a video path: every mode must answer its video cases exactly as
offline vLLM does (frames sampled by vLLM's own loader, encoded by the encoder in the
modes that have one). LLaVA has none: a video is a clear 400, and the mesh serves on.
"""

from __future__ import annotations

import httpx
import pytest
from support.cases import VIDEO_CASES, VIDEO_FAMILIES, ask_case
from support.content import data_url, png, user, video, video_part

VIDEO_PARAM = "messages[0].content[0].video_url"


def takes_video(mesh) -> bool:
    return mesh.family in VIDEO_FAMILIES


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_matches_offline_vllm(mesh, oracle, case, stream):
    if not takes_video(mesh):
        pytest.skip(f"{mesh.family} has no video path (test_a_model_without_video_says_so)")
    expected = oracle(mesh.family)[case]
    text, usage = ask_case(mesh, VIDEO_CASES[case], stream)
    assert text == expected["text"]
    assert usage.completion_tokens == len(expected["token_ids"])
    assert usage.prompt_tokens == expected["prompt_tokens"]


def test_video_changes_the_answer(mesh, oracle):
    # Guards the parity tests against a model that ignores its video.
    if not takes_video(mesh):
        pytest.skip(f"{mesh.family} has no video path")
    results = oracle(mesh.family)
    assert results["video"]["token_ids"] != results["two_videos"]["token_ids"]


def test_http_video_url_matches_data_url(mesh, oracle, image_server):
    if not takes_video(mesh):
        pytest.skip(f"{mesh.family} has no video path")
    url = image_server(f"/{mesh.family}/{mesh.mode.replace('/', '')}/one.mp4", video(1),
                       "video/mp4")  # fmt: skip
    kind, _, max_tokens = VIDEO_CASES["video"]
    text, usage = ask_case(mesh, (kind, user(video_part(url), "What happens?"), max_tokens), True)
    assert text == oracle(mesh.family)["video"]["text"]
    assert usage.prompt_tokens == oracle(mesh.family)["video"]["prompt_tokens"]


def _post(mesh, *parts: dict) -> httpx.Response:
    body = {"model": mesh.model, "messages": user(*parts, "What happens?"), "max_tokens": 4}
    return httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=60)


def test_a_model_without_video_says_so(mesh):
    if takes_video(mesh):
        pytest.skip(f"{mesh.family} has a video path")
    reply = _post(mesh, video_part(data_url(video(1), "video/mp4")))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] == "this model does not accept video"
    assert error["param"] == VIDEO_PARAM


def _bad_videos(image_server) -> list[tuple[str, str, int, str]]:
    whole = video(7)
    return [
        ("image as video", data_url(png(1), "video/mp4"), 415, "not a video"),
        ("text as video", data_url(b"hello there", "video/mp4"), 415, "not a video"),
        ("truncated", data_url(whole[: len(whole) // 2], "video/mp4"), 400, "cannot be opened"),
        ("too many frames", data_url(video(8, frames=200), "video/mp4"), 400, "frames"),
        ("too long", data_url(video(9, frames=40, fps=1.0), "video/mp4"), 400, "s long"),
        ("too large a frame", data_url(video(10, size=(320, 240)), "video/mp4"), 400, "pixels"),
        ("gif type", "data:image/gif;base64,R0lGODlh", 415, "unsupported media type"),
        ("loopback url", "http://127.0.0.1:9/x.mp4", 400, "refused"),
    ]


def test_bad_videos_get_clear_errors_and_the_mesh_serves_on(mesh, oracle, image_server):
    if not takes_video(mesh):
        pytest.skip(f"{mesh.family} has no video path")
    for name, url, status, message in _bad_videos(image_server):
        reply = _post(mesh, video_part(url))
        assert reply.status_code == status, (name, reply.text)
        error = reply.json()["error"]
        assert message in error["message"], (name, error)
        assert error["param"] == VIDEO_PARAM, name
    text, _ = ask_case(mesh, VIDEO_CASES["video"], stream=False)
    assert text == oracle(mesh.family)["video"]["text"]
