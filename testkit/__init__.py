"""Helpers shared by the tests, the benchmarks and the examples; never shipped in the wheel.

- :mod:`testkit.tinymodel`: small random-weight Llama models built locally (no model hub).
- :mod:`testkit.s3_server`: a real S3 server (moto) on 127.0.0.1, a fault-injecting proxy,
  and the pytest fixtures around them.
- :mod:`testkit.mooncake_server`: a real ``mooncake_master`` on 127.0.0.1 and its fixture.

Nothing in :mod:`vllm_kvtier` imports this package; ``tests/``, ``bench/`` and ``examples/``
reach it from the repository root (pytest puts the root on ``sys.path``; the scripts insert it).
"""
