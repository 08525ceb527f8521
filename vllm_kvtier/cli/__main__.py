"""``python -m vllm_kvtier.cli``: the ``kvtier`` command."""

import sys

from vllm_kvtier.cli import main

sys.exit(main())
