"""Runs cases through one plain offline vLLM engine and prints the results as JSON.

The correctness oracle: every mode of the mesh must give exactly these token ids and this
text with greedy sampling. Run as a subprocess (vLLM's engine wants a process of its own):
    python tests/support/oracle.py MODEL_DIR CASES.json
Each case is {"kind": "chat", "messages": [...]} or {"kind": "completion", "prompt": "..."},
plus "max_tokens", and optionally "temperature" and "seed" (a seeded sample, which every
engine draws alike), "ignore_eos", and "lora" with "lora_path" (the LoRA adapter to answer
with, by its name and directory).
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine in this process: no engine core and model process to start (each imports vLLM
# again) and no spinning between them; the answers are the same.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    written = json.dumps(cases)
    videos = "video_url" in written
    audios = "input_audio" in written or "audio_url" in written
    adapters = {case["lora"]: case["lora_path"] for case in cases if case.get("lora")}
    loras = {name: LoRARequest(name, index, path)
             for index, (name, path) in enumerate(sorted(adapters.items()), 1)}  # fmt: skip
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        limit_mm_per_prompt={"image": 8}
        | ({"video": 4} if videos else {})
        | ({"audio": 4} if audios else {}),
        seed=0,
        # As the tests' meshes serve adapters (support.meshes.LORA_FLAGS).
        **({"enable_lora": True, "max_lora_rank": 8, "max_loras": 3} if loras else {}),
    )
    results = []
    for case in cases:
        params = SamplingParams(
            temperature=case.get("temperature", 0),
            seed=case.get("seed"),
            max_tokens=case["max_tokens"],
            ignore_eos=case.get("ignore_eos", False),
        )
        lora = loras.get(case.get("lora", ""))
        if case["kind"] == "chat":
            (output,) = llm.chat(case["messages"], params, use_tqdm=False, lora_request=lora)
        else:
            (output,) = llm.generate(case["prompt"], params, use_tqdm=False, lora_request=lora)
        completion = output.outputs[0]
        results.append(
            {
                "text": completion.text,
                "token_ids": list(completion.token_ids),
                "prompt_tokens": len(output.prompt_token_ids),
                "finish_reason": completion.finish_reason,
            }
        )
    print("ORACLE " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
