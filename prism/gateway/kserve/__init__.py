"""KServe v2 gRPC (`inference.GRPCInferenceService`, as Triton serves it) over the
processor, with the tensors of Triton's vLLM backend, so that client code written for
Triton + vLLM works unchanged.

A request is a completion of a raw prompt, as in that backend: `text_input` is the prompt
as given (no chat template), with the model's image placeholder once for each `image`
(base64 JPEG or PNG); `sampling_parameters` is a JSON object of vLLM's sampling parameters
(values as JSON or as strings, as Triton clients send them); `stream` asks for one
response per delta (ModelStreamInfer only); without `exclude_input_in_output`, an answer
that is not streamed starts with the prompt. `return_finish_reason`,
`return_num_input_tokens` and `return_num_output_tokens` add those outputs.

The same front door as REST: the API key (metadata `authorization: Bearer KEY`), the
bound on generations in flight, the request deadline, request ids, metrics and spans.
"""
