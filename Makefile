# Targets named in the README. Everything sets itself up (tools/setup-venv.sh).
.PHONY: venv test test-fast demo bench bench-serving lint clean

venv:
	@tools/setup-venv.sh

test:
	@tests/run.sh

test-fast: venv   ## no vLLM engine: unit, connector and store-contract tests, none marked slow
	@KVTIER_TEST_PATHS="tests/unit tests/connector tests/tiers" tests/run.sh -m "not slow"

demo: venv
	@VLLM_LOGGING_LEVEL=WARNING .venv/bin/python examples/demo.py

bench: venv   ## CPU, NVMe, S3 tiers and TTFT; a table of ratios and bench/results/summary.png (kvtier bench --help)
	@VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=WARNING .venv/bin/python -m vllm_kvtier.cli bench \
		cpu_tier_throughput nvme_throughput s3_throughput ttft

bench-serving: venv   ## vLLM's API server without a connector, with the plugin, LMCache and the ideal: bench/serving.py (vLLM's bench serve, AIPerf multi-turn, a production trace), then bench/serving_soak.py (exactness at concurrency 4, a 20-minute soak)
	@tools/setup-client-venv.sh
	@VLLM_LOGGING_LEVEL=WARNING .venv/bin/python bench/serving.py
	@VLLM_LOGGING_LEVEL=WARNING .venv/bin/python bench/serving_soak.py

lint: venv   ## ruff (package, tests, benchmarks) and mypy (package); .ci/run runs it after the tests
	@tools/lint.sh && echo "lint: clean"

clean:
	rm -rf .venv .venv-client .venv-lmcache .venv-setup.log bench/results
