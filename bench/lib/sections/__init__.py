"""The sections of docs/benchmarks.md, a module each, by the record each renders: the
summary that opens the page (summary, from several records), the loads' (image, video,
audio: loads), anchors, scale, routing, planner (its simulated and its vLLM records),
planner_dynamo, choices and vllm_bench; what more than one of them uses is in common.
bench.lib.report puts the page together."""
