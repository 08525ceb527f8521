"""The NVMe tier: the store (store.py), its directory layout and locks (dirs.py), and
the file I/O engines (file_io.py: posix; NIXL's are in tiers/nixl/io_engine.py).
"""
