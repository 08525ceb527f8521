"""The NVMe tier beyond the common contract: restart, crash leftovers, damage by others,
namespaces, real OS write failures (disk full, read-only filesystem, file too large), and
the I/O engines (``posix``, NIXL's POSIX backend): each reads what the other wrote, and
damage read through NIXL is a counted miss like any other.

The failures are produced by the OS, not by mocks: a tiny tmpfs, a read-only bind mount
(both need root and mount permission, else skipped with the reason), and RLIMIT_FSIZE in a
subprocess (works anywhere).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.nixl_env import HAVE_NIXL, nixl_engine_env, nixl_env, requires_nixl
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.metrics import sample_key
from vllm_kvtier.tiers.chunkfile import ChunkHeader
from vllm_kvtier.tiers.keyed import NVMeTier
from vllm_kvtier.tiers.nvme import IOResult, NVMeStore, WriteBuffer

BLOCK = 3000
FILE = NVMeTier.file_bytes(BLOCK)
NS = "nvmetest00000000"
nixl_env = nixl_env  # fixtures: UCX/NIXL environment for the nixl engine's tests
nixl_engine_env = nixl_engine_env
#: the I/O engines that run here (nixl-gds needs CUDA and libcufile: see test_io_engine_errors_name_the_field)
ENGINES = ["posix", pytest.param("nixl", marks=[pytest.mark.nixl, requires_nixl])]


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def count(t: NVMeTier, metric: str) -> float:
    return t.counters.totals.get(sample_key(metric, t.name), 0)


def chunk_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def path_of(t: NVMeTier, k: bytes) -> Path:
    loc = t.location(k)
    assert loc is not None
    return loc[0]


def test_restart_finds_what_was_stored(tmp_path: Path) -> None:
    a = NVMeTier(tmp_path, 10 * FILE, BLOCK)
    for i in range(4):
        assert a.put(key(i), block(i))
        time.sleep(0.02)  # the restart order comes from file mtimes, which tick coarsely
    assert a.get(key(0)) == block(0)
    a.close()
    b = NVMeTier(tmp_path, 10 * FILE, BLOCK)
    assert b.usage_bytes() == 4 * FILE
    for i in range(4):
        assert b.contains(key(i)) and b.get(key(i)) == block(i)
    b.close()
    # Reopened smaller: the oldest written files go until it fits (reads do not touch mtime).
    c = NVMeTier(tmp_path, 2 * FILE, BLOCK)
    assert c.usage_bytes() == 2 * FILE
    assert not c.contains(key(0)) and not c.contains(key(1))
    assert c.get(key(3)) == block(3)
    c.close()
    assert len(chunk_files(c.store.dir)) == 2


def test_leftover_tmp_file_is_never_served_and_cleaned_at_start(tmp_path: Path) -> None:
    a = NVMeTier(tmp_path, 10 * FILE, BLOCK)
    assert a.put(key(1), block(1)) and a.put(key(2), block(2))
    a.close()
    # A complete, valid chunk that never got its final name (crash before rename).
    p = path_of(a, key(1))
    p.rename(p.parent / f".tmp-{p.stem}-deadbeef")
    (p.parent / ".tmp-partial-0badf00d").write_bytes(b"\0" * 100)
    b = NVMeTier(tmp_path, 10 * FILE, BLOCK)
    assert not b.contains(key(1)) and b.get(key(1)) is None
    assert b.get(key(2)) == block(2)
    assert not [n for n in chunk_files(b.store.dir) if n.startswith(".tmp-")]
    b.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_truncated_file_is_a_counted_miss(tmp_path: Path, direct_io, engine, caplog) -> None:
    t = NVMeTier(tmp_path, 10 * FILE, BLOCK, direct_io=direct_io, io_engine=engine)
    assert t.put(key(1), block(1)) and t.put(key(2), block(2))
    p = path_of(t, key(1))
    os.truncate(p, FILE - BLOCK // 2)  # cut inside the block, at an unaligned length
    with caplog.at_level(logging.WARNING):
        assert t.get(key(1)) is None
    assert "truncated" in caplog.text
    assert count(t, "load_failures") == 1 and not t.contains(key(1))
    assert t.get(key(2)) == block(2)  # serving continues
    assert t.put(key(3), block(3)) and t.get(key(3)) == block(3)
    t.close()
    assert not p.exists()  # the damaged file was deleted


@pytest.mark.parametrize("engine", ENGINES)
def test_file_overwritten_by_someone_else(tmp_path: Path, engine: str) -> None:
    t = NVMeTier(tmp_path, 10 * FILE, BLOCK, io_engine=engine)
    assert t.put(key(1), block(1)) and t.put(key(2), block(2))
    p1, p2 = path_of(t, key(1)), path_of(t, key(2))
    p1.write_bytes(os.urandom(FILE))  # same size, other bytes
    assert t.get(key(1)) is None
    assert count(t, "load_failures") == 1 and not t.contains(key(1))
    assert t.get(key(2)) == block(2)
    t.close()
    # At start, garbage with the final name (even a huge block count in its header) is
    # dropped and deleted; the rest is served.
    p1.write_bytes(b"\xff" * FILE)
    other = p2.with_name("0" * 32 + "-00000000.kvt")
    other.write_bytes(b"\0" * 10)
    u = NVMeTier(tmp_path, 10 * FILE, BLOCK, io_engine=engine)
    assert u.get(key(2)) == block(2) and not u.contains(key(1))
    assert not p1.exists() and not other.exists()
    u.close()


def test_namespace_mismatch_is_never_read(tmp_path: Path) -> None:
    a = NVMeTier(tmp_path, 10 * FILE, BLOCK, namespace="modelA")
    assert a.put(key(1), block(1))
    a.close()
    b = NVMeTier(tmp_path, 10 * FILE, BLOCK, namespace="modelB")
    assert not b.contains(key(1)) and b.get(key(1)) is None
    b.close()
    # Even placed inside modelB's directory, a modelA chunk is rejected by its header.
    shutil.copy(path_of(a, key(1)), b.store.dir)
    b2 = NVMeTier(tmp_path, 10 * FILE, BLOCK, namespace="modelB")
    assert not b2.contains(key(1)) and b2.usage_bytes() == 0
    assert chunk_files(b2.store.dir) == []
    b2.close()
    a2 = NVMeTier(tmp_path, 10 * FILE, BLOCK, namespace="modelA")
    assert a2.get(key(1)) == block(1)
    a2.close()


# ---- real OS write failures --------------------------------------------------------------


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextmanager
def mounted(target: Path, *how: list[str]) -> Iterator[None]:
    """Run the mount commands in ``how`` on ``target``; skip if the OS does not let us;
    always unmount what was mounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to make a real ENOSPC/EROFS filesystem")
    target.mkdir(parents=True, exist_ok=True)
    mounts = 0
    try:
        for cmd in how:
            r = _run(*cmd)
            if r.returncode != 0:
                pytest.skip(f"mount not permitted here: {' '.join(cmd)}: {r.stderr.strip()}")
            mounts += cmd[0] == "mount" and "remount" not in " ".join(cmd)
        yield
    finally:
        for _ in range(mounts):
            _run("umount", str(target))


@pytest.mark.parametrize("engine", ENGINES)
def test_disk_full_refuses_puts(tmp_path: Path, engine: str, caplog) -> None:
    root = tmp_path / "small"
    with mounted(root, ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)]):
        t = NVMeTier(root, 1000 * FILE, BLOCK, io_engine=engine)  # the tier thinks it has room; the disk has not
        stored = []
        with caplog.at_level(logging.WARNING):
            for i in range(64):
                if not t.put(key(i), block(i)):
                    break
                stored.append(i)
        assert 0 < len(stored) < 64
        assert count(t, "store_failures") == 1
        assert "No space left on device" in caplog.text and "disk_full" in caplog.text
        assert not t.contains(key(len(stored)))
        assert not [n for n in chunk_files(t.store.dir) if n.startswith(".tmp-")]
        assert all(t.get(key(i)) == block(i) for i in stored)  # reads keep serving
        for i in stored[:4]:
            assert t.delete(key(i))
        t.close()  # drains the deletes
        u = NVMeTier(root, 1000 * FILE, BLOCK, io_engine=engine)
        assert u.put(key(100), block(100)) and u.get(key(100)) == block(100)
        u.close()


def test_read_only_filesystem_refuses_puts(tmp_path: Path, caplog) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    t = NVMeTier(root, 10 * FILE, BLOCK)
    assert t.put(key(1), block(1))
    with mounted(
        root, ["mount", "--bind", str(root), str(root)], ["mount", "-o", "remount,bind,ro", str(root)]
    ):
        with caplog.at_level(logging.WARNING):
            assert not t.put(key(2), block(2))
        assert count(t, "store_failures") == 1
        assert "Read-only file system" in caplog.text and "read_only" in caplog.text
        assert t.get(key(1)) == block(1)
        t.close()


def test_file_size_limit_refuses_puts(tmp_path: Path) -> None:
    """EFBIG from RLIMIT_FSIZE, in a subprocess so the limit cannot touch pytest."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from vllm_kvtier.tiers.keyed import NVMeTier
        from vllm_kvtier.metrics import sample_key
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        t = NVMeTier(sys.argv[1], 10 * {FILE}, {BLOCK})
        assert t.put(b"k" * 32, bytes({BLOCK}))
        resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE} // 2, resource.RLIM_INFINITY))
        ok = t.put(b"j" * 32, bytes({BLOCK}))
        print("PUT", ok, t.counters.totals.get(sample_key("store_failures", "nvme"), 0))
        print("GET", t.get(b"k" * 32) == bytes({BLOCK}))
        t.close()
    """)
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "PUT False 1" in r.stdout and "GET True" in r.stdout
    assert "File too large" in r.stderr and "store_failure" in r.stderr


# ---- I/O engines ---------------------------------------------------------------------------


def wait_for(store: NVMeStore, job: int, timeout_s: float = 10.0) -> IOResult:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for r in store.poll():
            if r.job_id == job:
                return r
            r.release()
        store.wait(0.01)
    raise AssertionError(f"job {job} gave no result within {timeout_s} s")


def write_chunk(store: NVMeStore, file_id: str, first: int, n: int, job: int = 1) -> ChunkHeader:
    wb = WriteBuffer([key(first + i) for i in range(n)], BLOCK)
    for i in range(n):
        with wb.block(i) as b:
            b[:] = block(first + i)
    assert store.submit_write(job, file_id, wb)
    r = wait_for(store, job)
    assert r.ok and r.header is not None, r.reason
    return r.header


@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize(("writer", "reader"), [("posix", "nixl"), ("nixl", "posix")])
def test_engines_read_each_others_chunks(tmp_path: Path, writer: str, reader: str, direct_io: str) -> None:
    w = NVMeStore(tmp_path, NS, 0, BLOCK, direct_io=direct_io, io_engine=writer)  # type: ignore[arg-type]
    other = NVMeStore(tmp_path, NS, 0, BLOCK, direct_io=direct_io, io_engine=reader)  # type: ignore[arg-type]
    try:
        h = write_chunk(w, "mine", 0, 5)
        assert write_chunk(other, "theirs", 0, 5) == h
        # The same chunk written by either engine: the same bytes on disk.
        assert w.path("mine").read_bytes() == other.path("theirs").read_bytes()
        assert len(w.path("mine").read_bytes()) == h.total_bytes
        # A subset of its blocks, out of order, read back by the other engine.
        other.submit_read(2, "mine", h, [3, 1, 4])
        r = wait_for(other, 2)
        assert r.ok and r.blocks is not None, r.reason
        assert [b.tobytes() for b in r.blocks] == [block(3), block(1), block(4)]
        r.release()
    finally:
        w.close()
        other.close()
    # A tier reopened with the other engine finds and serves what the first one stored.
    t = NVMeTier(tmp_path / "tier", 10 * FILE, BLOCK, io_engine=writer, direct_io=direct_io)  # type: ignore[arg-type]
    assert t.put(key(7), block(7))
    t.close()
    u = NVMeTier(tmp_path / "tier", 10 * FILE, BLOCK, io_engine=reader, direct_io=direct_io)  # type: ignore[arg-type]
    assert u.get(key(7)) == block(7)
    u.close()


@pytest.mark.nixl
@requires_nixl
def test_damaged_block_read_through_nixl_is_a_counted_miss(tmp_path: Path) -> None:
    t = NVMeTier(tmp_path, 10 * FILE, BLOCK, io_engine="nixl")
    assert t.put(key(1), block(1)) and t.put(key(2), block(2))
    loc = t.location(key(1))
    assert loc is not None
    path, offset = loc
    with open(path, "r+b") as f:  # one bit of the block flipped, through the filesystem
        f.seek(offset + 17)
        b = f.read(1)
        f.seek(offset + 17)
        f.write(bytes([b[0] ^ 0x01]))
    assert t.get(key(1)) is None
    assert count(t, "load_failures") == 1 and not t.contains(key(1))
    assert t.get(key(2)) == block(2)
    t.close()
    assert not path.exists()


def test_io_engine_errors_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nixl_env: None) -> None:
    with pytest.raises(ConfigError, match="'posix', 'nixl', 'nixl-gds'") as e:
        NVMeStore(tmp_path, NS, 0, BLOCK, io_engine="spdk")
    assert e.value.field == "nvme.io_engine"
    if HAVE_NIXL:  # GDS needs CUDA and libcufile: where its plugin does not load, start-up says so
        try:
            NVMeStore(tmp_path, NS, 0, BLOCK, io_engine="nixl-gds").close()  # it loads here
        except ConfigError as err:
            assert err.field == "nvme.io_engine" and "GDS plugin, which does not load here" in str(err)
    # No nixl package: the install hint.
    for m in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, m, None)
    with pytest.raises(ConfigError, match="pip install nixl-cu12") as e:
        NVMeStore(tmp_path, NS, 0, BLOCK, io_engine="nixl")
    assert e.value.field == "nvme.io_engine"
