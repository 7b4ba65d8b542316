"""Audio validation from the header and decoding as vLLM decodes (no mesh)."""

import io
import struct

import numpy as np
import pytest
import soundfile
from support.content import png

from prism.media.audio import AudioDecoder, check_audio
from prism.media.policy import AudioLimits
from prism.rpc.errors import PrismError

PARAM = "messages[0].content[1].input_audio"
RATE = 16000


def tone(seconds: float = 1.0, rate: int = RATE, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def audio(fmt: str = "WAV", subtype: str | None = None, **shape) -> bytes:
    out = io.BytesIO()
    rate = shape.get("rate", RATE)
    soundfile.write(out, tone(**shape), rate, format=fmt, subtype=subtype)
    return out.getvalue()


@pytest.mark.parametrize("fmt,subtype,mime,codec", [
    ("WAV", "PCM_16", "audio/wav", "PCM"),
    ("FLAC", None, "audio/flac", "FLAC"),
    ("OGG", "VORBIS", "audio/ogg", "Vorbis"),
    ("MP3", None, "audio/mpeg", "MP3"),
])  # fmt: skip
def test_accepted_audio_is_decoded_to_mono_at_its_own_rate(fmt, subtype, mime, codec):
    data = audio(fmt, subtype)
    checked = check_audio(data, AudioLimits(), PARAM)
    assert (checked.mime_type, checked.codec, checked.sample_rate) == (mime, codec, RATE)
    # Lossy codecs pad a frame or two; PCM and FLAC are exact.
    assert checked.seconds == pytest.approx(1.0, abs=0.1 if codec in ("MP3", "Vorbis") else 0)
    samples, rate = AudioDecoder().decode(data)
    assert rate == RATE and samples.dtype == np.float32 and samples.ndim == 1


def test_stereo_is_averaged_as_vllm_does():
    data = audio(channels=2)
    assert check_audio(data, AudioLimits(), PARAM).channels == 2
    samples, _ = AudioDecoder().decode(data)
    assert samples.shape == (RATE,) and np.allclose(samples, tone(), atol=1e-4)


def test_a_clip_is_resampled_to_the_models_rate():
    samples, rate = AudioDecoder(16000).decode(audio(rate=44100))
    assert rate == 16000 and len(samples) == 16000
    # The tone survives: its strongest frequency is still 440 Hz.
    assert np.argmax(np.abs(np.fft.rfft(samples))) == 440


def _claims(data: bytes, seconds: int) -> bytes:
    """A WAV whose header says it holds `seconds` of 16-bit mono at 16 kHz."""
    size = seconds * RATE * 2
    data = bytearray(data)
    at = data.index(b"data")
    data[at + 4 : at + 8] = struct.pack("<I", size)
    data[4:8] = struct.pack("<I", size + at)
    return bytes(data)


def test_rejected_audio():
    whole, flac = audio(seconds=2.0), audio("FLAC", seconds=2.0)
    cases = {
        "empty": (b"", 400, "audio is empty"),
        "text": (b"hello, this is not audio at all", 415, "not audio"),
        "image": (png(1), 415, "not audio"),
        "codec": (audio("WAV", "GSM610"), 415, "unsupported audio codec gsm_ms"),
        "damaged": (b"RIFF\x00\x00\x00\x00WAVE" + bytes(64), 400, "cannot be opened"),
        "cut short": (whole[: len(whole) // 2], 400, "header says 64000 bytes of samples, 31978"),
        "claims hours": (_claims(whole, 3 * 3600), 400, "header says 345600000 bytes"),
        "flac cut short": (flac[: len(flac) // 2], 400, "cannot be decoded: flac decoder lost"),
        "hours long": (
            audio("WAV", "PCM_U8", rate=8000, seconds=3000),
            400,
            "3000.0 s long, more than the limit of 600 s",
        ),
        "sample rate": (audio(rate=384000, seconds=0.1), 400, "sample rate of 384000 Hz"),
        "channels": (audio(channels=16, seconds=0.1), 400, "16 channels; the limit is 8"),
    }
    for name, (data, status, message) in cases.items():
        with pytest.raises(PrismError) as info:
            check_audio(data, AudioLimits(), PARAM)
        assert info.value.http_status == status, name
        assert message in info.value.message, (name, info.value.message)
        assert info.value.param == PARAM


@pytest.mark.parametrize("limits,message", [
    (AudioLimits(max_bytes=1000), "bytes, more than the limit of 1000"),
    (AudioLimits(max_seconds=1.5), "2.0 s long, more than the limit of 1.5 s"),
    (AudioLimits(max_sample_rate=8000), "sample rate of 16000 Hz; the limit is 8000 Hz"),
    (AudioLimits(max_channels=1), "2 channels; the limit is 1"),
], ids=["bytes", "seconds", "rate", "channels"])  # fmt: skip
def test_caps_are_checked_from_the_header(limits, message):
    with pytest.raises(PrismError, match=message) as info:
        check_audio(audio(seconds=2.0, channels=2), limits, PARAM)
    assert info.value.http_status == 400
