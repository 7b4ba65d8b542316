"""What the benchmarks share, split by job: the load and its client (load), prompt text
(text), the servers they start (servers), vLLM's own benchmark client (vllm_client),
/metrics (metrics), profiling (profile), statistics (stats), the results files (results),
figures (plots), and docs/benchmarks.md rendered from the results (report; each of its
sections a module of sections). shapes names the servers and loads for runs and page alike."""
