"""Imported by every Python process started with this folder on ``PYTHONPATH``: the serving
benchmark's servers under ``--timeline`` (see ``bench/timeline.py``, loaded from beside this
folder whichever checkout's plugin the server runs). Does nothing unless
``KVTIER_BENCH_TIMELINE`` names the file to write."""

import os

if os.environ.get("KVTIER_BENCH_TIMELINE"):
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location(
        "kvtier_bench_timeline", Path(__file__).resolve().parent.parent / "timeline.py")
    _timeline = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_timeline)
    _timeline.install(os.environ["KVTIER_BENCH_TIMELINE"])
