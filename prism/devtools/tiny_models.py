"""Random-weight multimodal checkpoints small enough to serve with vLLM on a CPU.

`build` writes a directory that both `transformers` and plain vLLM load: config, float32
safetensors weights, a byte-level BPE tokenizer trained here on an embedded corpus, the
image (or audio) processor and a chat template shared by the tokenizer and the processor.
"""

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    WhisperFeatureExtractor,
)

# The families that take images (and the Qwen ones, videos), and the one that takes audio.
IMAGE_FAMILIES = ("llava", "qwen2-vl", "qwen2.5-vl")
AUDIO_FAMILIES = ("qwen2-audio",)
FAMILIES = (*IMAGE_FAMILIES, *AUDIO_FAMILIES)

VOCAB_SIZE = 1536
TEXT_HEAD_DIM = 64  # vLLM's CPU attention rejects head_dim 16; 64 is known to work.
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class TextSize:
    """The language model's dimensions."""

    hidden: int
    layers: int
    intermediate: int


# `tiny` for tests; `small` where computing a prompt should cost what it costs a real model
# next to the mesh's own overhead (benchmarks of prefix caching), still quick on a CPU.
SIZES = {"tiny": TextSize(128, 2, 256), "small": TextSize(256, 4, 1024)}
WEIGHTS_FILE = "model.safetensors"

# With their random initialisation the vision-to-text projectors let many different images
# give the same greedy continuation. Scaling both projector layers by 5 made 11-12 of 12
# plain, gradient and noise images give distinct 8-token continuations (seeds 0-2, both
# families); unscaled, LLaVA managed 9 and larger factors let fewer first tokens differ.
PROJECTOR_SCALE = 5.0

CORPUS = """\
The small robot walked along the quiet street and looked at every window it passed.
A red ball rolled down the hill, past the green trees, and stopped near the blue river.
In the morning the baker opens the shop, lights the oven and sells warm bread to everyone.
Children played in the park while their parents talked about the weather and the news.
The picture shows a yellow house with a white door, two windows and a tall chimney.
On the table there is a glass of water, a plate of apples and an old brown book.
She described the image carefully: a cat sleeping on a chair beside an open window.
Clouds moved slowly across the sky, and the light changed from gold to grey to purple.
The train left the station at noon and arrived in the city before the evening rain.
He counted the boats in the harbour: three were white, one was black and one was orange.
Every photograph tells a story about the people, the places and the time it was taken.
The teacher asked the class to draw a circle, a square and a triangle in different colours.
A gentle wind carried the smell of flowers from the garden into the kitchen.
Look closely at the left side of the image, where a small bird sits on a branch.
The mountains were covered with snow, and the valley below was bright and green.
What do you see in this picture? I see a dog, a bicycle and a wooden fence.
Please answer the question in one short sentence and describe only what is visible.
The assistant reads the message, thinks about the request and writes a helpful reply.
Numbers such as one, two, three, four, five, six, seven, eight, nine and ten are common.
The market was full of fruit: bananas, oranges, grapes, pears, lemons and cherries.
At night the city lights reflected on the water, and the streets became calm and quiet.
The scientist measured the temperature, wrote the result and compared it with yesterday.
A large map on the wall showed rivers, roads, forests and the names of many towns.
The musician played a slow song, and the audience listened without saying a word.
Write a caption for the image: a girl in a red coat walks her dog through the snow.
The room was dark except for a lamp that cast a warm circle of light on the floor.
Two friends shared lunch under a tree and talked about their plans for the summer.
The computer displayed a chart with bars of different heights and a line across the top.
When the sun rose, the birds began to sing and the farmer walked out to the field.
This is a simple sentence. This is another simple sentence. Short text is easy to read.
Autumn leaves drifted over the pavement, crunching softly beneath hurried footsteps.
The engineer explained how bridges carry heavy loads across wide rivers and deep canyons.
Our neighbour keeps bees, grows tomatoes, and repairs old clocks in his workshop.
During the storm, thunder shook the windows and lightning flashed above the hills.
A curious fox crept quietly toward the henhouse, but the farmer's dog barked loudly.
The library opens early on weekdays; students borrow novels, journals and dictionaries.
Fresh vegetables, spicy soup, roasted chicken and chocolate cake were served for dinner.
Astronomers observe distant galaxies through powerful telescopes on remote mountaintops.
Grandmother knitted a woollen scarf with stripes of crimson, violet, silver and turquoise.
The hospital nurse checked each patient, recorded their pulse, and brought fresh blankets.
Sailors navigated by the stars long before satellites guided ships across the ocean.
Please summarise the document, highlight important details, and list any open questions.
Bright kites danced above the beach while waves splashed against the sandy shore.
The museum exhibits ancient pottery, bronze statues, jewellery and painted manuscripts.
Quickly, the squirrel jumped between branches, gathering acorns before winter arrived.
Our journey through the forest took six hours, including a picnic beside a waterfall.
Mechanics replaced the worn tyres, adjusted the brakes and polished the shiny bumper.
Voters queued patiently outside the town hall, holding umbrellas against the drizzle.
The photograph is blurry, but you can recognise a lighthouse standing on rocky cliffs.
Zebras, giraffes, elephants and lions gathered around the muddy watering hole.
Jazz musicians improvised melodies, and the crowd clapped along to the lively rhythm.
Each morning, she jogs around the lake, stretches her legs and drinks cold juice.
The recipe requires flour, sugar, butter, eggs, milk, vanilla and a pinch of salt.
Firefighters rescued a frightened kitten stuck high in the branches of an oak tree.
Historians believe the castle was built nearly eight hundred years ago by a king.
Describe the colours, shapes, textures and objects that appear in the picture above.
Gardeners prune roses in early spring so that healthy flowers bloom during summer.
The software update fixed several bugs, improved performance and added new features.
Penguins waddled across the ice, diving into freezing water to catch small fish.
Thank you for your question; here is a short and accurate answer based on the image.
"""


# Hermes-style tools, as Qwen2.5 and NousResearch's Hermes models render them: the tools
# as JSON lines in a system turn, each call as JSON within <tool_call> tags, each tool
# result within <tool_response> tags in a user turn; so vLLM's `hermes` tool parser reads
# the tiny models' calls. `start` opens a turn of the role ROLE (a Jinja expression), `end`
# closes it. (Jinja as transformers runs it drops the newline after a block tag: a newline
# that follows one is written as an expression.)
def _chat_template(prefix: str, start: str, end: str, media: str) -> str:
    def turn(role: str) -> str:
        return start.replace("ROLE", role)

    content = (
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{media}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
    )
    return (
        prefix + "{% if tools %}" + turn("'system'") + "You may call one or more functions. "
        "Function signatures are within <tools></tools>:\n<tools>"
        "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
        "For each function call, return a JSON object within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        + end
        + "{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'tool' %}"
        "{% if loop.first or loop.previtem['role'] != 'tool' %}" + turn("'user'") + "{% endif %}"
        "<tool_response>\n" + content + "{{ '\\n' }}</tool_response>"
        "{% if loop.last or loop.nextitem['role'] != 'tool' %}" + end + "{% endif %}"
        "{% else %}"
        + turn("message['role']")
        + content
        + "{% for call in message.get('tool_calls') or [] %}"
        '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
        "{{ call.function.arguments | tojson }}}\n</tool_call>"
        "{% endfor %}" + end + "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}" + turn("'assistant'") + "{% endif %}"
    )


LLAVA_TEMPLATE = _chat_template(
    "{{ bos_token }}",
    "<|{{ ROLE }}|>\n",
    "</s>\n",
    "{% if part['type'] == 'image' %}<image>{% endif %}",
)
QWEN2_VL_TEMPLATE = _chat_template(
    "",
    "<|im_start|>{{ ROLE }}\n",
    "<|im_end|>\n",
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% endif %}",
)
# Qwen2-Audio's, numbering the audios of a conversation as it does.
QWEN2_AUDIO_TEMPLATE = _chat_template(
    "{% set audios = namespace(count=0) %}",
    "<|im_start|>{{ ROLE }}\n",
    "<|im_end|>\n",
    "{% if part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{% set audios.count = audios.count + 1 %}"
    "Audio {{ audios.count }}: <|audio_bos|><|AUDIO|><|audio_eos|>{{ '\\n' }}{% endif %}",
)
# Added to the trained vocabulary as plain (not special) tokens, as reasoning and tool
# calling models have them: so vLLM's `deepseek_r1` reasoning parser finds its markers,
# and they stay in the text that parsers read.
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def _train_tokenizer(special_tokens: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKERS),
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tokenizer.add_tokens([AddedToken(marker, normalized=False) for marker in MARKERS])
    return tokenizer


def _tokenizer(specials: list[str], chat_template: str, **named: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(specials),
        # Registering the placeholders as special tokens lets decoding skip them.
        extra_special_tokens=[token for token in specials if token not in named.values()],
        chat_template=chat_template,
        **named,
    )


def _text_config(tokenizer: PreTrainedTokenizerFast, size: TextSize) -> dict[str, object]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.hidden // TEXT_HEAD_DIM,
        "num_key_value_heads": size.hidden // TEXT_HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _scale(layers: list[torch.nn.Linear]) -> None:
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(PROJECTOR_SCALE)


def llava_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny LLaVA's tokenizer, trained here in about a second: for tests of text
    handling that need a real tokenizer and no model."""
    return _tokenizer(
        ["<unk>", "<s>", "</s>", "<pad>", "<image>"],
        LLAVA_TEMPLATE,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def _llava(size: TextSize) -> tuple[PreTrainedModel, ProcessorMixin]:
    tokenizer = llava_tokenizer()
    patch, image = 8, 32
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=image,
            patch_size=patch,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
        ),
        text_config=LlamaConfig(
            **_text_config(tokenizer, size),
            head_dim=TEXT_HEAD_DIM,
            bos_token_id=tokenizer.bos_token_id,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(image // patch) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlavaForConditionalGeneration(config)
    projector = model.model.multi_modal_projector
    _scale([projector.linear_1, projector.linear_2])
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": image}, crop_size={"height": image, "width": image}
        ),
        tokenizer=tokenizer,
        patch_size=patch,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
    )
    return model, processor


# Qwen2-VL and Qwen2.5-VL share their tokens, chat template, processors and language model;
# only the vision tower differs.
QWEN_PATCH, QWEN_MERGE, QWEN_TEMPORAL = 14, 2, 2


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ],
        QWEN2_VL_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def _qwen_config(tokenizer: PreTrainedTokenizerFast, size: TextSize) -> dict[str, object]:
    """The top-level config both Qwen families take, less the vision config."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "text_config": {
            **_text_config(tokenizer, size),
            "bos_token_id": ids("<|endoftext|>"),
            # transformers 5 reads M-RoPE from rope_parameters; the sections split the
            # 32 rotary frequency pairs of a 64-wide head over (temporal, height, width).
            "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12]},
        },
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "tie_word_embeddings": False,
    }


def _qwen_processor(
    processor: type[ProcessorMixin], tokenizer: PreTrainedTokenizerFast
) -> ProcessorMixin:
    # 4 to 16 merged tokens per image or frame keeps prompts short.
    unit = (QWEN_PATCH * QWEN_MERGE) ** 2
    common = {
        "patch_size": QWEN_PATCH,
        "merge_size": QWEN_MERGE,
        "temporal_patch_size": QWEN_TEMPORAL,
        "size": {"shortest_edge": 4 * unit, "longest_edge": 16 * unit},
    }
    return processor(
        image_processor=Qwen2VLImageProcessor(**common),
        tokenizer=tokenizer,
        # Capping pixels per frame is transformers' upcoming default; choosing it now also
        # silences the warning it prints on every load.
        video_processor=Qwen2VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=QWEN2_VL_TEMPLATE,
    )


def _qwen2_vl(size: TextSize) -> tuple[PreTrainedModel, ProcessorMixin]:
    tokenizer = qwen_tokenizer()
    config = Qwen2VLConfig(
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": size.hidden,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": QWEN_TEMPORAL,
        },
        **_qwen_config(tokenizer, size),
    )
    model = Qwen2VLForConditionalGeneration(config)
    merger = model.model.visual.merger.mlp
    _scale([merger[0], merger[2]])
    return model, _qwen_processor(Qwen2VLProcessor, tokenizer)


def _qwen2_5_vl(size: TextSize) -> tuple[PreTrainedModel, ProcessorMixin]:
    tokenizer = qwen_tokenizer()
    config = Qwen2_5_VLConfig(
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": size.hidden,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": QWEN_TEMPORAL,
            # Windows of 2x2 merged tokens, so that an image above the minimum size spans
            # several; the last block attends over the whole image, as in the real models.
            "window_size": 2 * QWEN_PATCH * QWEN_MERGE,
            "fullatt_block_indexes": [1],
            # The released checkpoints' value (transformers' default is 4).
            "tokens_per_second": 2,
        },
        **_qwen_config(tokenizer, size),
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    merger = model.model.visual.merger.mlp
    _scale([merger[0], merger[2]])
    return model, _qwen_processor(Qwen2_5_VLProcessor, tokenizer)


def qwen2_audio_tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>",
         "<|audio_eos|>"],
        QWEN2_AUDIO_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )  # fmt: skip


def qwen2_audio_extractor() -> WhisperFeatureExtractor:
    """Qwen2-Audio's released feature extractor: Whisper's, with 128 mel bins (16 kHz, a
    30 s window, 10 ms hops)."""
    return WhisperFeatureExtractor(feature_size=128, return_attention_mask=True)


def _qwen2_audio(size: TextSize) -> tuple[PreTrainedModel, ProcessorMixin]:
    tokenizer = qwen2_audio_tokenizer()
    config = Qwen2AudioConfig(
        # The released model's mel bins and 30 s window (1500 positions, which its encoder
        # requires of every input); a narrow, shallow tower.
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "d_model": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2",
            **_text_config(tokenizer, size),
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        },
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
    )
    model = Qwen2AudioForConditionalGeneration(config)
    _scale([model.model.multi_modal_projector.linear])
    processor = Qwen2AudioProcessor(
        qwen2_audio_extractor(), tokenizer, chat_template=QWEN2_AUDIO_TEMPLATE
    )
    return model, processor


_BUILDERS: dict[str, Callable[[TextSize], tuple[PreTrainedModel, ProcessorMixin]]] = {
    "llava": _llava,
    "qwen2-vl": _qwen2_vl,
    "qwen2.5-vl": _qwen2_5_vl,
    "qwen2-audio": _qwen2_audio,
}


def _vllm_weight_name(name: str) -> str:
    # transformers 5 saves the CLIP tower without its `vision_model.` level, which vLLM's
    # LLaVA loader requires; transformers maps either spelling back when loading.
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    # It saves Qwen2-Audio's language model a level too deep for vLLM's loader, the same way.
    if name.startswith("language_model.model.model."):
        return "language_model.model." + name.removeprefix("language_model.model.model.")
    return name


def build(family: str, out: pathlib.Path, seed: int = 0, size: str = "tiny") -> pathlib.Path:
    """Write a random-weight `family` checkpoint of `size` (SIZES) into `out` and return
    `out`."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Fork the RNG so that building does not disturb the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = _BUILDERS[family](SIZES[size])
    processor.save_pretrained(out)
    model.save_pretrained(out)
    weights = load_file(out / WEIGHTS_FILE)
    save_file(
        {_vllm_weight_name(name): tensor for name, tensor in weights.items()},
        out / WEIGHTS_FILE,
        metadata={"format": "pt"},
    )
    # safetensors writes through a private temporary file (mode 0600); let a server running
    # as another user read the weights like the rest of the directory.
    (out / WEIGHTS_FILE).chmod(0o644)
    return out
