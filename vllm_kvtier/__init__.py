"""vllm_kvtier: multi-tier KV cache offloading for vLLM (CPU DRAM, NVMe, object storage,
remote pools).

``import vllm_kvtier`` is cheap and does not import vLLM or torch; the connector (and the
``vllm.general_plugins`` entry point that registers it) lives in
:mod:`vllm_kvtier.connector`, the only package that imports vLLM.
"""

from __future__ import annotations

__version__ = "0.2.0"
