"""Audio validation and decoding, shared by every stage that takes audio.

Audio arrives as file bytes: WAV, FLAC, MP3, Ogg (Vorbis or Opus), M4A/MP4 (AAC or ALAC) or
WebM. `check_audio` reads the container's header with FFmpeg (PyAV, as vLLM's own loader
falls back to) and holds codec, sample rate, channels and duration to the policy's caps
before anything is decoded; then it decodes the whole stream with vLLM's loader, which
proves it whole (a file cut short decodes to less than its header says) and is what every
mode hands on, so that each sees the samples one vLLM engine would.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from prism.engine import media_io
from prism.media.modality import Files, Modality
from prism.media.policy import AudioLimits
from prism.proto.v1 import common_pb2
from prism.rpc.errors import check_size, invalid
from prism.rpc.errors import unsupported_media as unsupported

# Each container's type, then the other names clients give it.
MIME_TYPES = ("audio/wav", "audio/flac", "audio/mpeg", "audio/ogg", "audio/mp4", "audio/webm",
              "audio/x-wav", "audio/wave", "audio/x-flac", "audio/mp3", "audio/x-m4a",
              "audio/aac", "audio/opus")  # fmt: skip
# FFmpeg's names of the codecs a maintained decoder handles, by the name users know.
CODECS = {
    **{f"pcm_{kind}": "PCM" for kind in ("s16le", "s24le", "s32le", "f32le", "f64le", "u8")},
    **dict.fromkeys(("pcm_mulaw", "pcm_alaw"), "G.711"),
    "flac": "FLAC",
    **dict.fromkeys(("mp3", "mp3float"), "MP3"),
    "vorbis": "Vorbis",
    "opus": "Opus",
    "aac": "AAC",
    "alac": "ALAC",
}
_CODEC_NAMES = "PCM, FLAC, MP3, Vorbis, Opus, AAC or ALAC"
_CONTAINER_NAMES = "WAV, FLAC, MP3, Ogg, M4A or WebM"
# A FLAC header holds the exact number of samples: a file that decodes to fewer is cut.
# (Lossy streams cut short decode to what is there, as vLLM takes them.)
_EXACT = ("FLAC",)


@dataclass(frozen=True)
class LoadedAudio:
    data: bytes
    mime_type: str
    codec: str
    sample_rate: int
    channels: int
    # Its samples, decoded to mono at `sample_rate`.
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate

    def to_proto(self) -> common_pb2.Audio:
        return common_pb2.Audio(data=self.data, mime_type=self.mime_type)

    def span_attributes(self) -> dict[str, Any]:
        return {"bytes": len(self.data), "mime_type": self.mime_type, "codec": self.codec,
                "sample_rate": self.sample_rate, "channels": self.channels,
                "seconds": round(self.seconds, 3)}  # fmt: skip


def container(data: bytes) -> str | None:
    """The container's MIME type from its first bytes, or None if it is none we take."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "audio/wav"
    if data[:4] == b"fLaC":
        return "audio/flac"
    if data[:4] == b"OggS":
        return "audio/ogg"
    if data[4:8] == b"ftyp":
        return "audio/mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: WebM and Matroska
        return "audio/webm"
    # An ID3 tag, or an MPEG audio frame's sync word (11 bits set).
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "audio/mpeg"
    return None


def _wav_cut(data: bytes) -> tuple[int, int] | None:
    """(bytes of samples a WAV's `data` chunk says it holds, bytes there are) where it holds
    fewer; FFmpeg and libsndfile both take such a file as a shorter one."""
    at = 12
    while at + 8 <= len(data):
        size = int.from_bytes(data[at + 4 : at + 8], "little")
        if data[at : at + 4] == b"data":
            there = len(data) - at - 8
            return (size, there) if size > there else None
        at += 8 + size + (size & 1)
    return None


def _header(data: bytes, param: str) -> tuple[str, int, int, float | None]:
    """(codec, sample rate, channels, seconds where the header says) of the first audio
    stream, read without decoding."""
    import av  # heavy: only the stages that take audio

    try:
        with av.open(io.BytesIO(data)) as opened:
            if not opened.streams.audio:
                raise invalid("the file has no audio stream", param)
            stream = opened.streams.audio[0]
            name = stream.codec_context.name
            if stream.duration and stream.time_base:
                seconds = float(stream.duration * stream.time_base)
            elif opened.duration:
                seconds = opened.duration / 1_000_000
            else:
                seconds = None
            return name, stream.rate or 0, stream.channels or 0, seconds
    except av.error.FFmpegError:
        raise invalid("audio cannot be opened: the file is damaged or incomplete", param) from None


def check_audio(data: bytes, limits: AudioLimits, param: str) -> LoadedAudio:
    """Checks container, codec, size, sample rate, channels and length of audio bytes, and
    decodes them as vLLM does."""
    check_size(data, "audio", limits.max_bytes, param)
    mime_type = container(data)
    if mime_type is None:
        raise unsupported(f"not audio: use {_CONTAINER_NAMES}", param)
    cut = _wav_cut(data) if mime_type == "audio/wav" else None
    if cut:
        raise invalid(
            f"audio is cut short: its header says {cut[0]} bytes of samples, {cut[1]} arrived",
            param,
        )
    name, rate, channels, seconds = _header(data, param)
    codec = CODECS.get(name)
    if codec is None:
        raise unsupported(f"unsupported audio codec {name or 'unknown'}: use {_CODEC_NAMES}", param)
    if not 0 < rate <= limits.max_sample_rate:
        raise invalid(
            f"audio has a sample rate of {rate} Hz; the limit is {limits.max_sample_rate} Hz",
            param,
        )
    if not 0 < channels <= limits.max_channels:
        raise invalid(f"audio has {channels} channels; the limit is {limits.max_channels}", param)
    if seconds is not None and seconds > limits.max_seconds:
        raise invalid(
            f"audio is {seconds:.1f} s long, more than the limit of {limits.max_seconds:g} s",
            param,
        )
    try:
        samples, decoded_rate = media_io.load_audio(data)
    except ValueError as exc:
        raise invalid(f"audio cannot be decoded: {exc}", param) from None
    decoded = len(samples) / decoded_rate
    if decoded == 0:
        raise invalid("audio has no samples", param)
    if decoded > limits.max_seconds:  # a header that said less, or nothing
        raise invalid(
            f"audio is {decoded:.1f} s long, more than the limit of {limits.max_seconds:g} s",
            param,
        )
    # A frame's worth of slack: containers round their length to a frame or packet.
    if codec in _EXACT and seconds is not None and decoded < seconds - 0.05:
        raise invalid(
            f"audio is cut short: its header says {seconds:.2f} s, {decoded:.2f} s decode",
            param,
        )
    # The samples go: the engine's worker decodes the bytes again, and a long clip's
    # samples would outweigh its file many times over while the request lasts.
    return LoadedAudio(data, mime_type, codec, int(decoded_rate), channels, len(samples))


class AudioDecoder:
    """Checked audio bytes as an engine takes them: decoded as vLLM decodes them, at the
    model's rate (`rate`; None: the file's own), resampled as `media_io.resample_audio`
    says, so that the engine, given its own rate, has nothing left to resample."""

    def __init__(self, rate: int | None = None) -> None:
        self.rate = rate

    @classmethod
    def for_model(cls, model: str) -> AudioDecoder:
        return cls(media_io.audio_sampling_rate(model))

    def decode(self, data: bytes) -> tuple[Any, float]:
        """(mono float32 samples, their rate)."""
        try:
            samples, rate = media_io.load_audio(data)
        except ValueError as exc:
            raise ValueError(f"audio cannot be decoded: {exc}") from None
        if self.rate is None or rate == self.rate:
            return samples, rate
        return media_io.resample_audio(samples, rate, self.rate), self.rate


AUDIO = Modality(
    name="audio",
    part="audio",
    field="audios",
    cap="max_audios",
    token_keys=("audio_token_index", "audio_token_id"),
    files=Files(
        mime_types=MIME_TYPES,
        max_bytes=lambda policy: policy.audio.max_bytes,
        check=lambda data, policy, param: check_audio(data, policy.audio, param),
        in_thread=True,
    ),
)
