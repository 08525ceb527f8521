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
	@.venv/bin/pip install -q --no-deps -r requirements/dev.txt >/dev/null 2>&1
	@.venv/bin/python -m ruff check vllm_kvtier
	@.venv/bin/python -m mypy vllm_kvtier

clean:
	rm -rf .venv .venv-setup.log bench/results
