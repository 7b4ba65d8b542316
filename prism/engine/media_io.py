"""vLLM's media decoding, as Prism's media modules call it: images and videos decoded, and
video frames sampled, exactly as vLLM decodes and samples its own inputs, so that every
mode sees the pixels one vLLM engine would.

vLLM is imported inside each function: its multimodal modules are heavy, and only the
stages that check or decode media load them.
"""

from __future__ import annotations

from typing import Any


def load_image(data: bytes) -> Any:
    """The PIL image of encoded image bytes, as vLLM's `ImageMediaIO` decodes it."""
    from vllm.multimodal.media import ImageMediaIO

    return ImageMediaIO().load_bytes(data).media


def load_video(data: bytes, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """(frames as a uint8 (N, H, W, 3) array, vLLM's metadata of them) of container bytes,
    sampled by vLLM's `VideoMediaIO` with `kwargs` (its `media_io_kwargs` for video)."""
    from vllm.multimodal.media import ImageMediaIO, VideoMediaIO

    frames, metadata = VideoMediaIO(ImageMediaIO(), **kwargs).load_bytes(data).media
    return frames, metadata


def video_loader_backend(model: str) -> str | None:
    """The video loader vLLM's chat API uses for `model`: the one its video processor asks
    for, or None for vLLM's default."""
    from vllm.multimodal.video import get_video_loader_backend_for_processor
    from vllm.transformers_utils.processor import get_video_processor_cls_name_from_config

    processor = get_video_processor_cls_name_from_config(model)
    return get_video_loader_backend_for_processor(processor)


def opencv_video_api() -> int:
    """The OpenCV capture API vLLM's OpenCV video backend reads containers with."""
    from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

    return OpenCVVideoBackendMixin.get_cv2_video_api()


def opencv_video_metadata(capture: Any) -> Any:
    """vLLM's metadata of an open OpenCV capture: `total_frames_num`, `original_fps`,
    `duration`."""
    from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

    return OpenCVVideoBackendMixin.get_video_metadata(capture)


def load_audio(data: bytes) -> tuple[Any, float]:
    """(mono float32 samples, their sample rate) of audio file bytes, as vLLM's
    `AudioMediaIO` decodes them (at the file's own rate: resampling is the model's).
    Raises ValueError for bytes that do not decode, whichever decoder failed."""
    import soundfile
    from vllm.multimodal.media import AudioMediaIO

    try:
        return AudioMediaIO().load_bytes(data)
    except soundfile.LibsndfileError as exc:
        raise ValueError(exc.error_string.removeprefix("Error : ")) from None


def audio_sampling_rate(model: str) -> int | None:
    """The sample rate `model`'s feature extractor takes audio at; None where it has
    none (a model that takes no audio)."""
    from transformers import AutoFeatureExtractor

    try:
        return AutoFeatureExtractor.from_pretrained(model).sampling_rate
    except (OSError, ValueError, AttributeError):
        return None


def resample_audio(samples: Any, rate: float, target: float) -> Any:
    """`samples` at `target` Hz, by vLLM's resampler: with torchaudio, as vLLM's models
    resample by default, where it is installed; else with PyAV, vLLM's other resampler
    (torchaudio has no build for the CPU torch vLLM's CPU wheel takes)."""
    import importlib.util

    from vllm.multimodal.audio import AudioResampler

    method = "torchaudio" if importlib.util.find_spec("torchaudio") else "pyav"
    return AudioResampler(target_sr=target, method=method).resample(samples, orig_sr=rate)
