# Targets named in the README. Everything sets itself up (tools/setup-venv.sh).
.PHONY: venv test test-fast demo bench lint clean

venv:
	@tools/setup-venv.sh

test:
	@tests/run.sh

test-fast: venv   ## skip the multiprocess and API-server tests
	@tests/run.sh -m "not slow"

demo: venv
	@VLLM_LOGGING_LEVEL=WARNING .venv/bin/python examples/demo.py

bench: venv
	@.venv/bin/python bench/cpu_tier_throughput.py
	@.venv/bin/python bench/nvme_throughput.py
	@.venv/bin/python bench/s3_throughput.py
	@VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=WARNING .venv/bin/python bench/ttft.py

lint: venv
	@.venv/bin/python -m ruff check vllm_kvtier tests bench examples
	@.venv/bin/python -m ruff format --check vllm_kvtier

clean:
	rm -rf .venv .venv-setup.log bench/results
