PY := .venv/bin/python

.PHONY: setup demo test test-unit test-net lint protos check-protos bench bench-transfer bench-encoder bench-modes \
	bench-routing bench-choices bench-anchors bench-scale bench-planner bench-planner-vllm \
	bench-planner-dynamo bench-batch manifests docs bundle verify-gpu

# Prism in .venv; checkov in .venv-checkov, apart (make lint).
setup:
	scripts/setup.sh
	scripts/checkov.sh --setup

demo:
	$(PY) -m prism.ops.demo

# The unit lane first, on its own, so that its rule (no torch, no vLLM) is judged every time.
test: test-unit
	$(PY) -m pytest -q --durations=15 tests/contract tests/e2e

# The everyday loop: no engine, no subprocess, no torch or vLLM (tests/support/unit_lane.py).
test-unit:
	$(PY) -m pytest -q tests/unit

# An offline bundle (dist/bundle-cuda): the wheels Prism needs on the GPU hosts
# (scripts/gpu-host/: Python 3.12, torch 2.11.0+cu130) that their image lacks, in parts of
# at most 56 MiB (a part and the working tree within the 64 MiB a lease's call carries);
# scripts/install_offline.sh installs it there. BUNDLE_ARGS to change.
BUNDLE_ARGS ?= --target cuda --python 3.12 --part-mib 56 \
	--host-provides scripts/gpu-host/image-packages.txt --host-provides scripts/gpu-host/versions.txt
bundle:
	scripts/bundle.sh $(BUNDLE_ARGS) --out dist/bundle-$(word 2,$(BUNDLE_ARGS))

# Verifies the GPU path on this machine (scripts/verify_gpu.sh): smoke, parity of E/PD and
# E/P/D with offline vLLM, serving beside `vllm serve`, NIXL device to device, the encoder;
# every figure to bench/results/verify-gpu/ and docs/gpu.md. Without a GPU, its CPU form.
verify-gpu:
	PY=$(PY) scripts/verify_gpu.sh

# Only the tests on simulated hosts (network namespaces; root), which `make test` runs too.
test-net:
	$(PY) -m pytest -q tests/e2e/test_hosts.py

# Not a test: Prism in each mode against `vllm serve` at concurrency 1, 8 and 32 with an image
# per request (bench/results/latest.json), then EPD, E/PD and E/P/D with a video per request
# (bench/results/video.json), then every mode with a clip of audio per request
# (bench/results/audio.json), then every mode with the base model and two LoRA adapters asked
# in turn, three rounds (bench/results/lora.json), then vLLM's own client (`vllm bench serve`, sampled) against
# every mode and `vllm serve`, two rounds (bench/results/vllm_bench.json); all in
# docs/benchmarks.md.
bench:
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m prism.cli model build --family qwen2-vl --out models/tiny-qwen2-vl >/dev/null
	$(PY) -m bench.serve --model models/tiny-llava
	$(PY) -m bench.serve --model models/tiny-qwen2-vl --load video --modes epd,e/pd,e/p/d \
		--concurrency 1,8 --requests 128
	$(PY) -m prism.cli model build --family qwen2-audio --out models/tiny-qwen2-audio >/dev/null
	$(PY) -m bench.serve --model models/tiny-qwen2-audio --load audio \
		--modes epd,e/pd,e/p/d,ep/d --concurrency 1,8 --requests 128
	$(PY) -m bench.serve --model models/tiny-llava --load lora --modes epd,e/pd,e/p/d,ep/d \
		--concurrency 1,8 --requests 128 --rounds 3
	$(PY) -m bench.vllm_bench --model models/tiny-llava

# Not a test: Prism's modes beside the anchors of their shape, one run, three rounds: NVIDIA
# Dynamo 1.6.1 (aggregated, P/D, E/PD) from a virtualenv of its own (.anchors/dynamo, set up
# here once), vLLM's own P/D split (two engines, bench/pd_proxy.py) and `vllm serve`;
# bench/results/anchors.json and docs/benchmarks.md.
bench-anchors:
	scripts/bench_anchors.sh
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.serve --model models/tiny-llava --anchors --rounds 3 --requests 128

# Not a test: the front (gateway and processor in one process, and apart) before 16
# simulated workers at 64, 256 and 1024 streams, beside Dynamo's frontend before its mocker
# with the same timing (needs `make bench-anchors` once); bench/results/scale.json and
# docs/benchmarks.md.
bench-scale:
	scripts/bench_anchors.sh
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.scale --model models/tiny-llava --rounds 3 --fronts prism,prism-x2,prism-x2-i2,dynamo

# Not a test: the encoder's images/s at 32 concurrent one-image requests, with and without
# batching across requests (bench/results/encoder.json; docs/gpu.md).
bench-encoder:
	$(PY) -m prism.cli model build --family qwen2-vl --out models/tiny-qwen2-vl >/dev/null
	$(PY) -m bench.encoder --model models/tiny-qwen2-vl

# Not a test: NIXL vs inline protobuf vs memcpy, written to bench/results/transfer.json.
bench-transfer:
	$(PY) -m bench.transfer --out bench/results/transfer.json

# Not a test: round-robin, least-loaded and kv routing on two workers (EPD, E/PD), multi-turn
# image chats with long contexts, on the small LLaVA (prefill costs there what it should
# beside the mesh's own overhead); bench/results/routing.json and docs/benchmarks.md.
bench-routing:
	$(PY) -m prism.cli model build --family llava --size small --out models/small-llava >/dev/null
	$(PY) -m bench.routing --model models/small-llava

# Not a test: the planner against fixed splits of the same replica budget on a step load
# (text chats, image-heavy requests, text), E/PD on simulated workers and encoders made as
# slow as a larger vision tower; bench/results/planner.json and docs/benchmarks.md.
bench-planner:
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.planner --model models/tiny-llava

# Not a test: the same step load on real vLLM engines (the tiny LLaVA), fixed splits of
# three replicas against the planner; bench/results/planner-vllm.json.
bench-planner-vllm:
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.planner --model models/tiny-llava --engine vllm --budget 3 --fixed 1+2,2+1

# Not a test: Prism's planner beside NVIDIA Dynamo's (1.6.1, load mode, scaling dynamo.mocker
# workers) on one prefill/decode step load, the same budget of 4 replicas, engines of the same
# timing; Prism's fixed splits too (about 15 minutes; needs etcd: apt-get install etcd-server);
# bench/results/planner-dynamo.json and docs/benchmarks.md.
bench-planner-dynamo:
	scripts/bench_anchors_planner.sh
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.planner_dynamo --model models/tiny-llava

# Not a test: TTFT and total latency of one request in each mode, on the tiny LLaVA.
bench-choices:
	$(PY) -m prism.cli model build --family llava --size small --out models/small-llava >/dev/null
	$(PY) -m bench.choices --model models/small-llava

# Not a test: interactive chats at a fixed rate alone and beside a batch (the Batch API's, and
# the same chats from 8 clients), then `prism run-batch` beside `vllm run-batch` on one file;
# bench/results/batch.json and docs/benchmarks.md.
bench-batch:
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.batch --model models/tiny-llava

bench-modes:
	$(PY) -m prism.cli model build --family llava --out models/tiny-llava >/dev/null
	$(PY) -m bench.modes --model models/tiny-llava --out bench/results/modes.json

# buf breaking: the public contract changes only compatibly, checked against main's last
# commit (the stages' own package, prism.stage.v1, may change with the code that uses it).
# checkov: the hardening of the manifests, the Dockerfile and compose.yaml.
# lint-imports: the front loads neither vLLM nor torch, and only prism.engine imports vLLM
# ([tool.importlinter]).
lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports
	.venv/bin/buf lint
	.venv/bin/buf breaking --against "$$(git rev-parse --git-common-dir)#branch=main" --path protos/prism/v1
	.venv/bin/check-jsonschema --builtin-schema vendor.compose-spec compose.yaml
	$(MAKE) check-protos
	scripts/kubernetes_manifests.sh --check
	$(PY) scripts/flag_reference.py --check
	$(PY) -m bench.render --check
	scripts/checkov.sh

# deploy/kubernetes/: every mode's manifests, from `prism deploy kubernetes`; beside each, the
# Helm chart's values for the same mesh (deploy/helm/prism), from `prism deploy helm`.
manifests:
	scripts/kubernetes_manifests.sh

# docs/configuration.md: every flag of every command, from the CLI's own parsers;
# docs/benchmarks.md: from the benchmarks' results files (bench/results/) and notes.
docs:
	$(PY) scripts/flag_reference.py
	$(PY) -m bench.render

# The stubs of the public package (prism.v1), the stages' own (prism.stage.v1) and KServe
# v2's (package inference, served by the gateway), into prism/proto/, with grpc_tools (the
# protoc that matches the grpcio runtime).
protos:
	scripts/protos.sh

check-protos:
	scripts/check_protos.sh
