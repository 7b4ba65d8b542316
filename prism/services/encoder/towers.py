"""A checkpoint's media paths (its vision or audio tower + projector) on one device, in one
dtype, with the family's own HF image and video processors and audio feature extractor.

Only the towers' weights are ever read: the model is built on the meta device, the
language model dropped before anything is allocated, and the towers' tensors taken from
the checkpoint's safetensors one by one. A 7B checkpoint's encoder then holds its
0.3-0.7B tower parameters, not the 7B it would load and throw away.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForMultimodalLM, AutoProcessor
from transformers.utils import cached_file

from prism.media.audio import AUDIO, AudioDecoder
from prism.media.image import IMAGE, decode_image
from prism.media.modality import Modality
from prism.media.video import VIDEO, VideoDecoder
from prism.rpc.errors import invalid
from prism.services.encoder.audio import AudioPath
from prism.transfer.tensors import DTYPES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Embedding:
    """One item's embeddings and what the LLM needs besides them to place its tokens."""

    tensor: torch.Tensor
    grid_thw: tuple[int, ...] = ()
    # Qwen2.5-VL videos: seconds between temporal patches (0: the family has none).
    second_per_grid_ts: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def resolve_device(name: str) -> torch.device:
    """`auto`: the accelerator when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available")
    return device


def resolve_dtype(name: str, config: object, device: torch.device) -> torch.dtype:
    """`auto`: float32 on the CPU, as the CPU engine computes (prism.engine.launch),
    else the checkpoint's own 16-bit dtype (bfloat16 for a float32 checkpoint, as vLLM
    chooses on a GPU)."""
    if name != "auto":
        if name not in DTYPES or not DTYPES[name].is_floating_point:
            raise ValueError(f"--dtype {name!r} is not a floating-point dtype")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = DTYPES.get(stored)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def checkpoint_files(model: str) -> dict[str, list[str]]:
    """The checkpoint's safetensors files (local paths) and the tensor names in each, from
    its index when it is sharded."""
    index = cached_file(model, INDEX_FILE, _raise_exceptions_for_missing_entries=False)
    if index is None:
        single = cached_file(model, SINGLE_FILE)
        with safe_open(single, framework="pt") as weights:
            return {single: list(weights.keys())}
    weight_map: dict[str, str] = json.loads(Path(index).read_text())["weight_map"]
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    return {cached_file(model, file): names for file, names in files.items()}


def checkpoint_names(names: Iterable[str], module: str, own: set[str]) -> dict[str, str]:
    """Which checkpoint tensors hold `module`'s weights: checkpoint name → the module's own
    name of the tensor.

    Checkpoints name a module's tensors under a prefix ending in the module's name
    (`visual.` in Qwen's, `model.visual.` as transformers 5 keeps it in memory), and CLIP
    towers add a `vision_model.` level that transformers 5's module has not. The module's
    own names are matched exactly, under one such wrapper level at most: transformers'
    own renaming machinery is private to its loader."""
    found: dict[str, str] = {}
    marker = f"{module}."
    for name in names:
        head, sep, rest = name.partition(marker)
        if not sep or (head and not head.endswith(".")):
            continue
        if rest in own:
            found[name] = rest
        else:
            _, _, unwrapped = rest.partition(".")
            if unwrapped in own:
                found[name] = unwrapped
    return found


def load_media_model(model: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model's inner module (`model.model`) with its towers and projectors on `device`
    and no language model, never having allocated the language model's weights."""
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        full = AutoModelForMultimodalLM.from_config(config, dtype=dtype)
    full.eval()
    inner = full.model
    inner.language_model = None
    meta = inner.state_dict()
    wanted = {
        module: set(child.state_dict()) for module, child in inner.named_children()
    }  # fmt: skip
    loaded: dict[str, torch.Tensor] = {}
    for file, names in checkpoint_files(model).items():
        matches = {
            name: f"{module}.{own}"
            for module, own_names in wanted.items()
            for name, own in checkpoint_names(names, module, own_names).items()
        }
        if not matches:
            continue
        with safe_open(file, framework="pt", device=str(device)) as weights:
            for name, key in matches.items():
                loaded[key] = weights.get_tensor(name).to(dtype=meta[key].dtype)
    missing = {f"{m}.{own}" for m, names in wanted.items() for own in names} - set(loaded)
    if missing:
        raise ValueError(
            f"{model}: the checkpoint lacks {len(missing)} tower weights, e.g. "
            f"{sorted(missing)[:3]}"
        )
    # The tensors read become the parameters: no second copy of the weights, ever.
    inner.load_state_dict(loaded, strict=True, assign=True)
    for tensor in inner.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    # Buffers that are no checkpoint's (rotary frequencies, position ids) are computed by
    # transformers' own initialization, which leaves tensors marked as loaded alone.
    for module in inner.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                setattr(module, name, torch.empty_like(buffer, device=device))
    full.initialize_weights()
    return inner


class MediaEncoder:
    """The family's own HF image and video processors and vision path (tower + projector),
    or its audio feature extractor and audio path. Videos are sampled by `videos` (as vLLM
    samples them for the model), where the model takes video at all. One forward pass runs
    at a time: on one device, concurrent passes only contend, and the batcher
    (prism.services.encoder.batching) makes big ones."""

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        videos: VideoDecoder | None = None,
    ):
        self.config = AutoConfig.from_pretrained(model)
        processor = AutoProcessor.from_pretrained(model)
        self.image_processor = getattr(processor, "image_processor", None)
        self.video_processor = getattr(processor, "video_processor", None)
        feature_extractor = getattr(processor, "feature_extractor", None)
        self.videos = videos
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self._lock = threading.Lock()
        # How each modality the model takes is encoded, by modality name: a batch of items'
        # bytes to their embeddings.
        self.encoders: dict[str, Callable[[Sequence[bytes]], list[Embedding]]] = {}
        if self.image_processor is None and feature_extractor is None:
            return
        self.model = load_media_model(model, self.device, self.dtype)
        if self.image_processor is not None:
            self.encoders[IMAGE.name] = self.encode
        if self.video_processor is not None:
            self.encoders[VIDEO.name] = self.encode_videos
        if feature_extractor is not None:
            decoder = AudioDecoder(feature_extractor.sampling_rate)
            self.audio = AudioPath(self.model, feature_extractor, decoder, self._on_device)
            self.encoders[AUDIO.name] = self.encode_audios

    def takes(self, modality: Modality) -> bool:
        return modality.name in self.encoders

    def sampling(self, modality: Modality) -> Mapping[str, object] | None:
        """What shapes an item's embeddings besides its bytes: a video's frame sampling."""
        if modality is VIDEO and self.videos is not None:
            return self.videos.kwargs
        return None

    def _feature_kwargs(self) -> dict:
        if self.config.model_type == "llava":
            return {
                "vision_feature_layer": self.config.vision_feature_layer,
                "vision_feature_select_strategy": self.config.vision_feature_select_strategy,
            }
        return {}

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(self.device, dtype=dtype, non_blocking=True)

    def encode(self, images: Sequence[bytes]) -> list[Embedding]:
        pixels = [decode_image(data) for data in images]
        inputs = self.image_processor(images=pixels, return_tensors="pt")
        grid = inputs.get("image_grid_thw")
        kwargs = self._feature_kwargs()
        if grid is not None:
            kwargs["image_grid_thw"] = self._on_device(grid)
        with self._lock, torch.inference_mode():
            output = self.model.get_image_features(
                pixel_values=self._on_device(inputs["pixel_values"]), **kwargs
            )
        return _embeddings(output.pooler_output, grid)

    def encode_videos(self, videos: Sequence[bytes]) -> list[Embedding]:
        if self.video_processor is None or self.videos is None:
            raise invalid("this model does not accept video", "videos")
        decoded = [self.videos.decode(data) for data in videos]
        inputs = self.video_processor(videos=[frames for frames, _ in decoded], return_tensors="pt")
        grid = inputs["video_grid_thw"]
        with self._lock, torch.inference_mode():
            output = self.model.get_video_features(
                pixel_values_videos=self._on_device(inputs["pixel_values_videos"]),
                video_grid_thw=self._on_device(grid),
            )
        embeddings = _embeddings(output.pooler_output, grid)
        if self.config.model_type != "qwen2_5_vl":
            return embeddings
        # Qwen2.5-VL places video tokens in time: the seconds a temporal patch spans, at
        # the rate the frames were sampled, as vLLM's own processor computes them.
        patch = self.video_processor.temporal_patch_size
        return [
            replace(embedding, second_per_grid_ts=patch / sampled_fps(metadata))
            for embedding, (_, metadata) in zip(embeddings, decoded, strict=True)
        ]

    def encode_audios(self, clips: Sequence[bytes]) -> list[Embedding]:
        features, frames = self.audio.features(clips)
        with self._lock, torch.inference_mode():
            return [Embedding(tensor) for tensor in self.audio(features, frames)]


def sampled_fps(metadata: dict) -> float:
    """Frames a second of a sampled video, from vLLM's metadata of it."""
    return len(metadata["frames_indices"]) / metadata["total_num_frames"] * metadata["fps"]


def _embeddings(features: Sequence[torch.Tensor], grid: torch.Tensor | None) -> list[Embedding]:
    """One batch's features, split per item, with each item's grid."""
    return [
        Embedding(
            feature.contiguous(),
            tuple(int(v) for v in grid[i].tolist()) if grid is not None else (),
        )
        for i, feature in enumerate(features)
    ]
