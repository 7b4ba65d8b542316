"""Client code for Triton + vLLM, as its users write it with `tritonclient[grpc]`, run
against Prism's KServe port: `python triton_client.py PLAN.json` prints what each step
got, as JSON.

A process of its own: tritonclient's generated messages and the gateway's (the same
`inference` package, from another file) cannot share one process's descriptor pool.
"""

from __future__ import annotations

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def inputs(prompt: str, sampling: dict, stream: bool, image: str = "", **flags: bool) -> list:
    """The tensors of Triton's vLLM backend, as its samples build them."""
    tensors = []

    def add(name: str, datatype: str, value: np.ndarray) -> None:
        tensor = triton.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)

    add("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_))
    add("stream", "BOOL", np.array([stream], dtype=bool))
    add("sampling_parameters", "BYTES", np.array([json.dumps(sampling).encode()], np.object_))
    if image:
        add("image", "BYTES", np.array([image.encode()], dtype=np.object_))
    for name, value in flags.items():
        add(name, "BOOL", np.array([value], dtype=bool))
    return tensors


def stream(client: triton.InferenceServerClient, model: str, requests: list[dict]) -> list:
    """Sends every request on one stream: each one's text, or (its id being out of reach
    of an error callback) the stream's error message."""
    replies: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    for index, request in enumerate(requests):
        client.async_stream_infer(model, inputs(**request, stream=True), request_id=str(index))
    pieces: dict[str, list[str]] = {str(i): [] for i in range(len(requests))}
    done: set[str] = set()
    errors: list[str] = []
    while len(done) + len(errors) < len(requests):
        result, error = replies.get(timeout=120)
        if error is not None:
            errors.append(str(error))
            continue
        response = result.get_response()
        output = result.as_numpy("text_output")
        if output is not None:
            pieces[response.id].extend(o.decode() for o in output)
        if response.parameters["triton_final_response"].bool_param:
            done.add(response.id)
    client.stop_stream()
    return [
        "".join(pieces[str(i)]) if str(i) in done else {"error": errors}
        for i in range(len(requests))
    ]


def main(plan: dict) -> dict:
    client = triton.InferenceServerClient(plan["url"])
    model, prompt, sampling = plan["model"], plan["prompt"], plan["sampling"]
    out: dict = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model),
        "metadata": client.get_model_metadata(model, as_json=True),
        "config": client.get_model_config(model, as_json=True),
    }
    result = client.infer(
        model,
        inputs(prompt, sampling, False, return_finish_reason=True, return_num_output_tokens=True,
               return_num_input_tokens=True),
    )  # fmt: skip
    out["infer"] = {
        "text": result.as_numpy("text_output")[0].decode(),
        "finish_reason": result.as_numpy("finish_reason")[0].decode(),
        "num_input_tokens": int(result.as_numpy("num_input_tokens")[0]),
        "num_output_tokens": int(result.as_numpy("num_output_tokens")[0]),
    }
    excluded = client.infer(
        model, inputs(plan["image_prompt"], sampling, False, plan["image"],
                      exclude_input_in_output=True)
    )  # fmt: skip
    out["infer_image"] = excluded.as_numpy("text_output")[0].decode()
    out["stream"] = stream(
        client,
        model,
        [
            {"prompt": prompt, "sampling": sampling},
            {"prompt": plan["image_prompt"], "sampling": sampling, "image": plan["image"]},
            # Fails alone; the stream goes on.
            {"prompt": prompt, "sampling": {"temperature": "hot"}},
        ],
    )
    errors = {}
    wrong_name = inputs(prompt, sampling, False)
    wrong_name[0] = triton.InferInput("prompt", [1], "BYTES")
    wrong_name[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    wrong_type = inputs(prompt, sampling, False)
    wrong_type[1] = triton.InferInput("stream", [1], "INT32")
    wrong_type[1].set_data_from_numpy(np.array([0], dtype=np.int32))
    unknown = inputs(prompt, sampling, False)
    cases = (("name", wrong_name, model), ("type", wrong_type, model),
             ("model", unknown, "no-such-model"))  # fmt: skip
    for name, tensors, target in cases:
        try:
            client.infer(target, tensors)
            errors[name] = None
        except InferenceServerException as exc:
            errors[name] = {"status": exc.status(), "message": exc.message()}
    out["errors"] = errors
    client.close()
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as plan_file:
        print(json.dumps(main(json.load(plan_file))))
