"""The processor stage: the public `InferenceService`.

It applies the model's chat template, tokenizes, loads and validates images and videos
(and checks image embeddings a client sent), runs the request through the pipeline of its
mode (prism.services.processor.pipeline, with failover), and turns the token ids that come
back into text deltas (prism.engine.detokenize).

A request goes as through vLLM's v1 engine, one job a module: rendered by its kind
(chat.py, completion.py) and checked (checks.py); fanned out into its n choices and merged
back (fan_out.py); each choice answered (choice.py). servicer.py holds the handlers;
serving.py starts the stage and tracks its readiness.
"""
