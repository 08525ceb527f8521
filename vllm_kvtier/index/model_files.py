"""The files of a model directory that its fingerprint covers, and what says each is
unchanged on this host. Files are only listed and read: nothing is unpickled or parsed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

#: Suffixes of the files holding weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Small files next to the weights that change what is computed (hashed whole).
CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json", "hf_quant_config.json",
                "quantization_config.json", "adapter_config.json")
#: A config file beyond this is not one: hashed by its size and sampled windows only.
MAX_CONFIG_BYTES = 4 << 20
#: Subdirectory levels of a model directory that are searched for weight files.
MAX_DEPTH = 1


def config_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    return data if len(data) <= MAX_CONFIG_BYTES else b"too-big:" + hashlib.sha256(data).digest()


def model_files(root: Path) -> Iterator[tuple[str, Path]]:
    if root.is_file():
        yield root.name, root
        return
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        # vLLM loads from the top level; one level below is read too (stricter, cheap),
        # deeper trees (training checkpoints kept beside the model) are not walked.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < MAX_DEPTH else []
        for name in filenames:
            full = Path(dirpath) / name
            # regular files only (symlinks followed: a hub snapshot links to its blobs); a
            # FIFO or device named like a weight file would block or never end
            if (name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_FILES) and full.is_file():
                found.append((full.relative_to(root).as_posix(), full))
    yield from sorted(found)


#: What says a file is unchanged on this host: size, mtime_ns, ctime_ns, inode, device.
FileState = tuple[int, int, int, int, int]


def file_state(st: os.stat_result) -> FileState:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def signature(files: list[tuple[str, Path]]) -> tuple[tuple[str, FileState], ...]:
    return tuple((rel, file_state(full.stat())) for rel, full in files)
