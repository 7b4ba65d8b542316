"""OpenAI parameter parity: the same REST requests sent to `vllm serve` (the reference,
started here on the tiny model) and to a mesh's gateway, their answers made comparable.

`reference(model, log)` starts `vllm serve`, sends every case, stops it and returns the
answers; `ask(base_url, case)` sends one case anywhere; `comparable(answer)` keeps what
must be equal (texts, finish reasons, tokens, logprobs, usage) in one shape for streamed
and whole answers.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from prism.runtime import processes
from prism.runtime.ports import free_port
from prism.services.processor.serving import context_length
from support.content import data_url, image_part, png, user

# A schema whose every answer is short: the random-weight model cannot run on forever.
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


# How `vllm serve` and the meshes under test parse tool calls, and reasoning besides.
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
REASONING_FLAGS = (*TOOL_FLAGS, "--reasoning-parser", "deepseek_r1")


def _function(name: str, properties: dict, **extra: Any) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters, **extra}}


# Strict tools with enumerated arguments: every call a random-weight model makes ends.
WEATHER = _function(
    "get_weather",
    {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    description="The weather in a city.",
    strict=True,
)
CLOCK = _function("get_time", {"zone": {"enum": ["UTC", "CET"]}}, strict=True)
TOOLS = [WEATHER, CLOCK]
# A call and its result, in the history of a conversation.
CALLED = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 20 C."},
]


def _streamed(case: tuple[str, dict]) -> tuple[str, dict]:
    return case[0], {**case[1], "stream": True}


@functools.cache
def _image_url(seed: int, size: tuple[int, int]) -> str:
    # Cached: every test builds the cases again, and a large image takes a while.
    return data_url(png(seed, size))


def _image(seed: int, size: tuple[int, int] = (64, 48)) -> dict:
    return image_part(_image_url(seed, size))


def _chat(*parts: Any, **body: Any) -> tuple[str, dict]:
    return "chat/completions", {"messages": user(*parts), "temperature": 0, **body}


def _completion(prompt: str | list[int], **body: Any) -> tuple[str, dict]:
    return "completions", {"prompt": prompt, "temperature": 0, **body}


@functools.cache
def _tokenizer(model: str) -> Any:
    # Here, not at the top: transformers loads torch, which the unit lane never loads.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@functools.cache
def _no_whitespace(model: str) -> dict[str, int]:
    """A logit bias that bars every token of blanks only: JSON lets the random-weight model
    pad with blanks until max_tokens, and the cases must end in JSON that parses."""
    tokenizer = _tokenizer(model)
    blanks = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()]
    return {str(i): -100 for i in blanks}


def _token(model: str | None, token: str) -> str:
    if model is None:
        return "0"
    return str(_tokenizer(model).convert_tokens_to_ids(token))


def tool_cases(model: str | None) -> dict[str, tuple[str, dict]]:
    """Tool calling as the servers started with TOOL_FLAGS answer it."""
    no_blanks = _no_whitespace(model) if model else {}
    required = _chat(
        _image(8),
        "Call a tool.",
        max_tokens=200,
        tools=TOOLS,
        tool_choice="required",
        logit_bias=no_blanks,
    )
    named = _chat(
        "What time is it?",
        max_tokens=80,
        tools=TOOLS,
        logit_bias=no_blanks,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    # Auto leaves strict tools' calls to the model: the bias makes it start one each time.
    auto = _chat(
        "Weather?",
        max_tokens=150,
        tools=TOOLS,
        tool_choice="auto",
        logit_bias={**no_blanks, _token(model, "<tool_call>"): 100},
    )
    return {
        "tools_required": required,
        "tools_required_stream": _streamed(required),
        "tools_named": named,
        "tools_named_stream": _streamed(named),
        "tools_auto": auto,
        "tools_auto_stream": _streamed(auto),
        "tools_one_call": (required[0], {**required[1], "parallel_tool_calls": False}),
        "tools_none": _chat("Hello.", max_tokens=8, tools=TOOLS, tool_choice="none"),
        "tools_auto_text": _chat("Hello.", max_tokens=8, tools=[CLOCK]),
        "tools_history": (
            "chat/completions",
            {"messages": CALLED, "tools": TOOLS, "max_tokens": 8, "temperature": 0},
        ),
        "tools_history_stream": (
            "chat/completions",
            {"messages": CALLED, "tools": TOOLS, "max_tokens": 8, "temperature": 0, "stream": True},
        ),
        "bad_tools_empty": _chat("x", max_tokens=4, tools=[]),
        "bad_tool_choice_unknown": _chat(
            "x",
            max_tokens=4,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_nothing"}},
        ),
        "bad_tool_choice_without_tools": _chat("x", max_tokens=4, tool_choice="required"),
    }


def reasoning_cases(model: str | None) -> dict[str, tuple[str, dict]]:
    """Reasoning as the servers started with REASONING_FLAGS answer it: with this seed and
    bias the sampled answers of the tiny LLaVA end their reasoning at the fourth token."""
    no_blanks = _no_whitespace(model) if model else {}
    ends = {_token(model, "</think>"): 4}
    reasoned = _chat("Think first.", max_tokens=16, temperature=1.0, seed=0, logit_bias=ends)
    called = _chat(
        "Think, then call.",
        max_tokens=120,
        temperature=1.0,
        seed=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        logit_bias={**no_blanks, **ends},
    )
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    responded = _response(
        "Think first.", max_output_tokens=16, temperature=1.0, seed=0, logit_bias=ends
    )
    return {
        "reasoning": reasoned,
        "reasoning_stream": (reasoned[0], {**reasoned[1], **streamed}),
        "reasoning_only": _chat("Think.", max_tokens=6),
        "reasoning_only_stream": _streamed(_chat("Think.", max_tokens=6)),
        "reasoning_then_call": called,
        "reasoning_then_call_stream": (called[0], {**called[1], **streamed}),
        # The Responses API: the reasoning as an item of its own.
        "responses_reasoning": responded,
        "responses_reasoning_stream": _streamed(responded),
    }


def large_cases(model: str | None) -> dict[str, tuple[str, dict]]:
    """The largest inputs a mesh takes: as many images as it allows, a large image, and
    prompts at the edge of the context (token ids, so that their length is exact)."""
    context = context_length(model) if model else 0
    token = int(_token(model, "a"))
    return {
        "images_eight": _chat(*(_image(40 + i) for i in range(8)), "What differs?", max_tokens=6),
        "image_1024": _chat(_image(48, (1024, 1024)), "Describe it.", max_tokens=6),
        # 20 tokens of room: the 32 asked for are cut to them.
        "context_nearly_full": _completion([token] * (context - 20), max_tokens=32),
        "bad_context_full": _completion([token] * context, max_tokens=4),
        "bad_context_exceeded": _completion([token] * (context + 1), max_tokens=4),
    }


def cases(model: str | None) -> dict[str, tuple[str, dict]]:
    """Name -> (path under /v1, body without `model`), for the model in directory `model`
    (None: the names only matter)."""
    no_blanks = _no_whitespace(model) if model else {}
    # Makes every token a comma: the stop string then comes first, and stays.
    commas = {str(_tokenizer(model).convert_tokens_to_ids(",")): 100} if model else {}
    chat_logprobs = _chat(_image(5), "Describe it.", max_tokens=8, logprobs=True, top_logprobs=5)
    completion_logprobs = _completion("The quick brown fox", max_tokens=6, logprobs=3)
    sampled = _chat("Tell me a story.", max_tokens=6, n=3, temperature=1.0, seed=7)
    return {
        "chat_logprobs": chat_logprobs,
        "chat_logprobs_stream": (chat_logprobs[0], {**chat_logprobs[1], "stream": True}),
        "chat_logprobs_no_top": _chat("Hi", max_tokens=4, logprobs=True),
        "completion_logprobs": completion_logprobs,
        "completion_logprobs_stream": (
            completion_logprobs[0],
            {**completion_logprobs[1], "stream": True},
        ),
        "completion_echo": _completion("Once upon a time", max_tokens=4, echo=True, logprobs=2),
        "completion_prompt_logprobs": _completion("A B C D", max_tokens=2, prompt_logprobs=2),
        "n_seeded": sampled,
        "n_seeded_stream": (
            sampled[0],
            {**sampled[1], "stream": True, "stream_options": {"include_usage": True}},
        ),
        "completion_n": _completion("Hello", max_tokens=5, n=2, temperature=0.8, seed=3),
        "json_schema": _chat(
            _image(6),
            "Answer in JSON.",
            max_completion_tokens=48,
            logit_bias=no_blanks,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            },
        ),
        "json_object": _chat(
            "JSON please.",
            max_tokens=24,
            logit_bias=no_blanks,
            response_format={"type": "json_object"},
        ),
        "choice": _chat("Yes or no?", max_tokens=8, structured_outputs={"choice": ["yes", "no"]}),
        "regex": _completion(
            "Code:", max_tokens=12, structured_outputs={"regex": "[a-c]{3}-[0-9]"}
        ),
        "grammar": _chat(
            "Pick.",
            max_tokens=12,
            structured_outputs={"grammar": 'root ::= "cat" | "dog" | "bird"'},
        ),
        "logit_bias": _chat("Say something.", max_tokens=5, logit_bias={"17": 100}),
        "stop_included": _completion(
            "1, 2, 3",
            max_tokens=12,
            stop=[","],
            include_stop_str_in_output=True,
            logit_bias=commas,
        ),
        "continuous_usage": _chat(
            "Count.",
            max_tokens=4,
            stream=True,
            user="someone",
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        "bad_schema": _chat(
            "x",
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
            },
        ),
        "bad_regex": _completion("x", max_tokens=4, structured_outputs={"regex": "(unclosed"}),
        # vLLM: several choices need sampling.
        "bad_n_greedy": _completion("Hello", max_tokens=5, n=2),
        **tool_cases(model),
        **responses_cases(model),
        **messages_cases(),
        **large_cases(model),
    }


# A follow-up names the case it continues: "@name" stands for that answer's id.
FOLLOWS = "@"


def _response(input_: Any, **body: Any) -> tuple[str, dict]:
    return "responses", {"input": input_, "temperature": 0, **body}


def _flat(tool: dict) -> dict:
    """A chat tool as the Responses API writes it (no `function` level)."""
    return {"type": "function", **tool["function"]}


def responses_cases(model: str | None) -> dict[str, tuple[str, dict]]:
    """The Responses API (POST /v1/responses), as `vllm serve` answers it."""
    no_blanks = _no_whitespace(model) if model else {}
    image = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in it?"},
                {"type": "input_image", "image_url": data_url(png(9))},
            ],
        }
    ]
    text = _response("Say hello.", max_output_tokens=8)
    with_image = _response(image, max_output_tokens=8)
    # As tools_auto: the bias makes the model start a call; the stop string ends it after
    # one (a whole answer cut short is not parsed into calls).
    called = _response(
        "Weather?",
        max_output_tokens=150,
        tools=[_flat(WEATHER)],
        logit_bias={**no_blanks, _token(model, "<tool_call>"): 100},
        stop=["</tool_call>"],
        include_stop_str_in_output=True,
    )
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 20 C."},
    ]
    return {
        "responses_text": text,
        "responses_text_stream": _streamed(text),
        "responses_instructions": _response(
            "Say hello.", instructions="Be brief.", max_output_tokens=8
        ),
        "responses_image": with_image,
        "responses_image_stream": _streamed(with_image),
        "responses_schema": _response(
            "Answer in JSON.",
            max_output_tokens=48,
            logit_bias=no_blanks,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "answer",
                    "schema": SCHEMA,
                    "strict": True,
                }
            },
        ),
        "responses_tool_call": called,
        "responses_tool_call_stream": _streamed(called),
        "responses_tool_output": _response(history, tools=[_flat(WEATHER)], max_output_tokens=8),
        "responses_logprobs": _response(
            "Hi", max_output_tokens=4, top_logprobs=3, include=["message.output_text.logprobs"]
        ),
        "followup_responses_text": _response(
            "And again.", max_output_tokens=8, previous_response_id=f"{FOLLOWS}responses_text"
        ),
    }


def _messages(content: Any, **body: Any) -> tuple[str, dict]:
    return "messages", {"messages": [{"role": "user", "content": content}], "temperature": 0,
                        "max_tokens": 8, **body}  # fmt: skip


def messages_cases() -> dict[str, tuple[str, dict]]:
    """Anthropic's Messages API (POST /v1/messages), as `vllm serve` answers it."""
    png_data = _image_url(9, (64, 48)).split(",", 1)[1]
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": png_data}},
             {"type": "text", "text": "What is in it?"}]  # fmt: skip
    text, with_image = _messages("Say hello."), _messages(image)
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
    # A call of the tool named: its strict schema's enums end the call.
    named = _messages("Weather?", max_tokens=200, tools=[tool],
                      tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                           "name": "get_weather",
                                           "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "Sunny, 20 C."}]},
    ]  # fmt: skip
    return {
        "messages_text": text,
        "messages_text_stream": _streamed(text),
        "messages_image": with_image,
        "messages_image_stream": _streamed(with_image),
        # Stop strings a short answer is likely to hold: the one matched is named.
        "messages_system_stop": _messages(
            "Tell me about the river.", system="Be brief.", max_tokens=16,
            stop_sequences=["e", "a", " "],
        ),
        "messages_tool_named": named,
        "messages_tool_named_stream": _streamed(named),
        "messages_tool_result": ("messages", {**_messages("")[1], "messages": history,
                                              "tools": [tool]}),
        # The prompt's tokens, its image's included.
        "messages_count_tokens": ("messages/count_tokens", {
            "system": "Be brief.", "messages": [{"role": "user", "content": image}]}),
        "bad_messages_no_max_tokens": ("messages", {
            "messages": [{"role": "user", "content": "Hi"}]}),
    }  # fmt: skip


def following(case: tuple[str, dict], answers: dict[str, dict]) -> tuple[str, dict]:
    """`case` with the id of the answer its previous_response_id names ("@name")."""
    path, body = case
    previous = body.get("previous_response_id")
    if not isinstance(previous, str) or not previous.startswith(FOLLOWS):
        return case
    return path, {**body, "previous_response_id": answers[previous[1:]]["body"]["id"]}


def ask(base_url: str, model: str, case: tuple[str, dict], timeout: float = 120) -> dict:
    """One case's answer: {"status", "body"} or, streamed, {"status", "chunks"}."""
    path, body = case
    body = {**body, "model": model}
    url = f"{base_url}/{path}"
    if not body.get("stream"):
        reply = httpx.post(url, json=body, timeout=timeout)
        return {"status": reply.status_code, "body": reply.json()}
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=timeout) as reply:
        if reply.status_code != 200:
            return {"status": reply.status_code, "body": json.loads(reply.read())}
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    return {"status": 200, "chunks": chunks}


def reference(
    model: str, log: Path, flags: tuple[str, ...] = TOOL_FLAGS, named: Any = cases
) -> dict[str, dict]:
    """The answers of `vllm serve` on `model`, started with `flags`, to the cases
    `named(model)`."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--limit-mm-per-prompt",
        json.dumps({"image": 8}),
        "--uvicorn-log-level",
        "warning",
        # The model run inside the engine core, as Prism's CPU workers run it
        # (prism.engine.launch): one process fewer to start; the answers are the same.
        "--distributed-executor-backend",
        "uni",
        *flags,
    ]
    # The Responses API's store, which previous_response_id needs, is off by default.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_ENABLE_RESPONSES_API_STORE": "1"}  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        answers: dict[str, dict] = {}
        for name, case in named(model).items():
            answers[name] = ask(f"{base_url}/v1", model, following(case, answers))
        return answers
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            processes.reap(process)


def _chat_logprobs(logprobs: dict | None) -> list | None:
    if logprobs is None:
        return None
    return [
        (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
        for e in logprobs["content"]
    ]


def _completion_logprobs(logprobs: dict | None) -> list | None:
    if logprobs is None:
        return None
    return list(
        zip(
            logprobs["tokens"],
            logprobs["token_logprobs"],
            logprobs["text_offset"],
            [sorted((t or {}).items()) for t in logprobs["top_logprobs"]],
            strict=True,
        )
    )


def _items(output: list[dict]) -> list[dict]:
    """A response's output items, less their random ids."""
    items = []
    for item in output:
        kept = {"type": item["type"], "status": item.get("status")}
        if item["type"] == "message":
            kept["content"] = [
                {"text": part["text"], "logprobs": _chat_logprobs({"content": part["logprobs"]})
                 if part.get("logprobs") else None}
                for part in item["content"]
            ]  # fmt: skip
        elif item["type"] == "reasoning":
            kept["content"] = item.get("content")
        else:
            kept |= {"name": item["name"], "arguments": item["arguments"],
                     "call_id_ok": bool(TOOL_CALL_ID.fullmatch(item["call_id"]))}  # fmt: skip
        items.append(kept)
    return items


def _response_summary(response: dict) -> dict:
    usage = response["usage"]
    return {
        "response_status": response["status"],
        "incomplete_details": response["incomplete_details"],
        "output": _items(response["output"]),
        "usage": (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]),
    }


def event_kinds(kinds: list[str]) -> list[str]:
    """Event types in order, a run of deltas as one: how many tokens a delta carries is
    the server's timing (vLLM joins those that came while the client was being written)."""
    return [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]


def comparable_response(answer: dict) -> dict:
    """A Responses answer: its status, output items and token counts; streamed, the event
    types in order and the deltas joined too."""
    if "body" in answer:
        return {"status": 200, **_response_summary(answer["body"])}
    events = answer["chunks"]
    deltas: dict[str, str] = {}
    for event in events:
        if event["type"].endswith(".delta"):
            deltas[event["type"]] = deltas.get(event["type"], "") + event["delta"]
    return {
        "status": 200,
        "events": event_kinds([event["type"] for event in events]),
        "numbered": [event["sequence_number"] for event in events] == list(range(len(events))),
        "deltas": deltas,
        **_response_summary(events[-1]["response"]),
    }


# vLLM's tool call ids: random, so compared by form.
TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


def _tool_calls(into: dict, calls: list[dict], streamed: bool) -> None:
    """Each call's name and arguments; streamed pieces joined by index."""
    for position, call in enumerate(calls):
        index = call["index"] if streamed else position
        entry = into["tool_calls"].setdefault(index, {"name": "", "arguments": ""})
        function = call.get("function") or {}
        entry["name"] += function.get("name") or ""
        entry["arguments"] += function.get("arguments") or ""
        if "id" in call:
            entry["id_ok"] = bool(TOOL_CALL_ID.fullmatch(call["id"]))


def _message_usage(usage: dict) -> list[int]:
    """A Messages answer's prompt tokens (those read from the prefix cache counted apart
    or not) and output tokens."""
    prompt = usage.get("input_tokens", 0) + (usage.get("cache_read_input_tokens") or 0)
    return [prompt, usage["output_tokens"]]


def _message_block(block: dict) -> dict:
    """A content block less what is random (ids, signatures)."""
    return {k: v for k, v in block.items() if k not in ("id", "signature")}


def comparable_message(answer: dict) -> dict:
    """A Messages answer: its content blocks, stop reason and sequence, and usage;
    streamed, the event types in order (a run of deltas as one) and the blocks built from
    the deltas."""
    if "body" in answer:
        body = answer["body"]
        return {"status": 200, "content": [_message_block(b) for b in body["content"]],
                "stop": [body["stop_reason"], body.get("stop_sequence")],
                "usage": _message_usage(body["usage"])}  # fmt: skip
    blocks: dict[int, dict] = {}
    kinds, stop, usage = [], None, None
    fields = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "input"}
    for event in answer["chunks"]:
        kind = event["type"]
        if kind == "content_block_start":
            block = _message_block(event["content_block"])
            blocks[event["index"]] = {**block, "input": ""} if "input" in block else block
        elif kind == "content_block_delta" and event["delta"]["type"] in fields:
            delta = event["delta"]
            field = fields[delta["type"]]
            kind = f"{kind}.{delta['type']}"
            value = delta.get("partial_json", delta.get(field, ""))
            blocks[event["index"]][field] += value
        elif kind == "message_delta":
            stop = [event["delta"]["stop_reason"], event["delta"].get("stop_sequence")]
            usage = _message_usage(event["usage"])
        if kind != "content_block_delta":
            kinds.append(kind)
    for block in blocks.values():
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["input"] or "{}")
    runs = [k for i, k in enumerate(kinds) if not (k.startswith("content_block_delta.")
                                                     and kinds[i - 1] == k)]  # fmt: skip
    content = [blocks[i] for i in sorted(blocks)]
    return {"status": 200, "events": runs, "content": content, "stop": stop, "usage": usage}


def comparable(answer: dict) -> dict:
    """Per choice index: text (the content), reasoning, tool calls, finish reason,
    logprobs; and the usage."""
    if answer["status"] != 200:
        return {"status": answer["status"]}
    first = (answer.get("chunks") or [answer.get("body")])[0] or {}
    if first.get("type") in ("message", "message_start"):
        return comparable_message(answer)
    if "chunks" in answer and answer["chunks"] and "type" in answer["chunks"][0]:
        return comparable_response(answer)
    if answer.get("body", {}).get("object") == "response":
        return comparable_response(answer)
    if "chunks" not in answer and "choices" not in answer["body"]:
        return {"status": 200, "body": answer["body"]}
    choices: dict[int, dict] = {}
    usage = None
    for message in answer.get("chunks") or [answer["body"]]:
        usage = message.get("usage") or usage
        for choice in message["choices"]:
            into = choices.setdefault(
                choice["index"], {"text": "", "logprobs": None, "reasoning": "", "tool_calls": {}}
            )
            part = choice["delta"] if "delta" in choice else choice.get("message")
            text = part.get("content") if part is not None else choice["text"]
            into["text"] += text or ""
            if part is not None:
                into["reasoning"] += part.get("reasoning") or ""
                _tool_calls(into, part.get("tool_calls") or [], "delta" in choice)
                if "message" in choice:
                    into["content_null"] = part.get("content") is None
            if choice.get("finish_reason"):
                into["finish_reason"] = choice["finish_reason"]
            logprobs = (_chat_logprobs if part is not None else _completion_logprobs)(
                choice.get("logprobs")
            )
            if logprobs is not None:
                into["logprobs"] = (into["logprobs"] or []) + logprobs
            if choice.get("prompt_logprobs") is not None:
                into["prompt_logprobs"] = choice["prompt_logprobs"]
    counts = None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"])
    return {"status": 200, "choices": dict(sorted(choices.items())), "usage": counts}
