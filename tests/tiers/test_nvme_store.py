"""The NVMe store beyond the common contract (tests/tiers/contract.py): restart, crash
leftovers, damage by others, namespaces, real OS write failures (disk full, read-only
filesystem, file too large), and the I/O engines (``posix``, NIXL's POSIX backend): each
reads what the other wrote, and damage read through NIXL is a miss like any other.

The failures are produced by the OS, not by mocks: a tiny tmpfs, a read-only bind mount
(both need root and mount permission, else skipped with the reason), and RLIMIT_FSIZE in a
subprocess (works anywhere).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.stores import nvme_section
from tests.nixl_env import HAVE_NIXL, nixl_engine_env, nixl_env, requires_nixl
from vllm_kvtier.chunkformat import ChunkHeader, align_up, header_bytes_for
from vllm_kvtier.errors import ConfigError, FailureReason
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import WriteBuffer
from vllm_kvtier.tiers.nvme.dirs import (
    LOCK_NAME,
    DirectoryLocked,
    UnsafeDirectory,
    collect_namespace,
    foreign_namespaces,
    lock_holder,
)
from vllm_kvtier.tiers.nvme.store import NVMeStore
from vllm_kvtier.tiers.registry import StoreContext

BLOCK = 3000
FILE = header_bytes_for(1) + align_up(BLOCK)  # one one-block chunk on disk
FILE_2 = header_bytes_for(2) + 2 * align_up(BLOCK)  # one two-block chunk on disk
NS = "nvmetest00000000"
nixl_env = nixl_env  # fixtures: UCX/NIXL environment for the nixl engine's tests
nixl_engine_env = nixl_engine_env
#: the I/O engines that run here (nixl-gds needs CUDA and libcufile: see test_io_engine_errors_name_the_field)
ENGINES = ["posix", pytest.param("nixl", marks=[pytest.mark.nixl, requires_nixl])]


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def chunk_files(d: Path) -> list[str]:
    """Every entry of a rank directory but its lock file."""
    return sorted(p.name for p in d.iterdir() if p.name != LOCK_NAME)


def wait_for(store: NVMeStore, job: int, timeout_s: float = 10.0) -> IOResult:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for r in store.poll():
            if r.job_id == job:
                return r
            r.release()
        store.wait(0.01)
    raise AssertionError(f"job {job} gave no result within {timeout_s} s")


def submit_chunk(store: NVMeStore, chunk_id: str, first: int, n: int, job: int) -> IOResult:
    wb = WriteBuffer([key(first + i) for i in range(n)], BLOCK)
    for i in range(n):
        with wb.block(i) as b:
            b[:] = block(first + i)
    assert store.submit_write(job, chunk_id, wb)
    return wait_for(store, job)


def write_chunk(store: NVMeStore, chunk_id: str, first: int, n: int, job: int = 1) -> ChunkHeader:
    r = submit_chunk(store, chunk_id, first, n, job)
    assert r.ok and r.header is not None, r.reason
    return r.header


def read_blocks(store: NVMeStore, chunk_id: str, header: ChunkHeader | None, positions: list[int],
                first: int = 0, job: int = 100) -> list[bytes] | FailureReason:
    """The blocks' bytes, or the reason the read failed."""
    store.submit_read(job, chunk_id, header, positions, [key(first + p) for p in positions])
    r = wait_for(store, job)
    if not r.ok:
        assert r.reason is not None
        return r.reason
    assert r.blocks is not None
    out = [b.tobytes() for b in r.blocks]
    r.release()
    return out


def test_restart_finds_what_was_stored(tmp_path: Path) -> None:
    a = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    headers = {f"c{i}": write_chunk(a, f"c{i}", 10 * i, 3, job=i) for i in range(4)}
    assert read_blocks(a, "c0", headers["c0"], [2]) == [block(2)]
    a.close()
    b = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    found = b.scan(cleanup=True)
    assert found.found == headers and found.problems == {}
    for i in range(4):  # read with the scanned header, and with none (probed from the file)
        assert read_blocks(b, f"c{i}", found.found[f"c{i}"], [0, 2], first=10 * i) == [block(10 * i), block(10 * i + 2)]
        assert read_blocks(b, f"c{i}", None, [1], first=10 * i) == [block(10 * i + 1)]
    b.close()


def test_leftover_tmp_file_is_never_served_and_cleaned_at_start(tmp_path: Path) -> None:
    a = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    write_chunk(a, "one", 1, 1, job=1)
    write_chunk(a, "two", 2, 1, job=2)
    a.close()
    # A complete, valid chunk that never got its final name (crash before rename).
    p = a.path("one")
    p.rename(p.parent / f".tmp-{p.stem}-deadbeef")
    (p.parent / ".tmp-partial-0badf00d").write_bytes(b"\0" * 100)
    b = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    res = b.scan(cleanup=True)
    assert set(res.found) == {"two"} and res.problems == {"partial_write": 2}
    assert read_blocks(b, "one", None, [0], first=1) is FailureReason.MISSING
    assert read_blocks(b, "two", res.found["two"], [0], first=2) == [block(2)]
    assert not [n for n in chunk_files(b.dir) if n.startswith(".tmp-")]
    b.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_truncated_file_is_a_miss(tmp_path: Path, direct_io, engine, caplog) -> None:
    t = NVMeStore(nvme_section(tmp_path, direct_io=direct_io, io_engine=engine), StoreContext(NS, 0, BLOCK))
    h1 = write_chunk(t, "one", 1, 1, job=1)
    h2 = write_chunk(t, "two", 2, 1, job=2)
    os.truncate(t.path("one"), FILE - BLOCK // 2)  # cut inside the block, at an unaligned length
    with caplog.at_level(logging.WARNING):
        got = read_blocks(t, "one", h1, [0], first=1)
    assert got is FailureReason.TRUNCATED and got.damaged
    assert "truncated" in caplog.text
    assert read_blocks(t, "two", h2, [0], first=2) == [block(2)]  # serving continues
    h3 = write_chunk(t, "three", 3, 1, job=3)
    assert read_blocks(t, "three", h3, [0], first=3) == [block(3)]
    t.close()
    u = NVMeStore(nvme_section(tmp_path, direct_io=direct_io, io_engine=engine), StoreContext(NS, 0, BLOCK))
    res = u.scan(cleanup=True)
    assert set(res.found) == {"two", "three"} and res.problems == {"truncated": 1}
    assert not t.path("one").exists()  # the damaged file was deleted by its owner's scan
    u.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_file_overwritten_by_someone_else(tmp_path: Path, engine: str) -> None:
    t = NVMeStore(nvme_section(tmp_path, io_engine=engine), StoreContext(NS, 0, BLOCK))
    h1 = write_chunk(t, "one", 1, 1, job=1)
    h2 = write_chunk(t, "two", 2, 1, job=2)
    p1, p2 = t.path("one"), t.path("two")
    p1.write_bytes(os.urandom(FILE))  # same size, other bytes
    assert read_blocks(t, "one", h1, [0], first=1) is FailureReason.CHECKSUM
    assert read_blocks(t, "one", None, [0], first=1) is FailureReason.FORMAT  # not even a chunk
    assert read_blocks(t, "two", h2, [0], first=2) == [block(2)]
    t.close()
    # At start, garbage with the final name (even a huge block count in its header) is
    # dropped and deleted; the rest is served.
    p1.write_bytes(b"\xff" * FILE)
    other = p2.with_name("0" * 32 + "-00000000.kvt")
    other.write_bytes(b"\0" * 10)
    u = NVMeStore(nvme_section(tmp_path, io_engine=engine), StoreContext(NS, 0, BLOCK))
    res = u.scan(cleanup=True)
    assert set(res.found) == {"two"} and sum(res.problems.values()) == 2
    assert read_blocks(u, "two", res.found["two"], [0], first=2) == [block(2)]
    assert not p1.exists() and not other.exists()
    u.close()


def test_namespace_mismatch_is_never_read(tmp_path: Path) -> None:
    a = NVMeStore(nvme_section(tmp_path), StoreContext("modelA", 0, BLOCK))
    write_chunk(a, "one", 1, 1)
    a.close()
    b = NVMeStore(nvme_section(tmp_path), StoreContext("modelB", 0, BLOCK))
    assert b.scan(cleanup=True).found == {}
    # Even placed inside modelB's directory, a modelA chunk is rejected by its header.
    shutil.copy(a.path("one"), b.dir)
    assert read_blocks(b, "one", None, [0], first=1) is FailureReason.NAMESPACE
    res = b.scan(cleanup=True)
    assert res.found == {} and res.problems == {"namespace": 1}
    assert chunk_files(b.dir) == []
    b.close()
    a2 = NVMeStore(nvme_section(tmp_path), StoreContext("modelA", 0, BLOCK))
    found = a2.scan().found
    assert read_blocks(a2, "one", found["one"], [0], first=1) == [block(1)]
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
        t = NVMeStore(nvme_section(root, io_engine=engine), StoreContext(NS, 0, BLOCK))
        stored: dict[str, ChunkHeader] = {}
        failed = None
        with caplog.at_level(logging.WARNING):
            for i in range(64):
                r = submit_chunk(t, f"c{i}", i, 1, job=i)
                if not r.ok:
                    failed = r
                    break
                assert r.header is not None
                stored[f"c{i}"] = r.header
        assert 0 < len(stored) < 64
        assert failed is not None and failed.reason is FailureReason.DISK_FULL and not failed.reason.damaged
        assert "No space left on device" in caplog.text and "disk_full" in caplog.text
        assert not t.path(failed.chunk_id).exists()
        assert not [n for n in chunk_files(t.dir) if n.startswith(".tmp-")]
        for j, (cid, h) in enumerate(stored.items()):  # reads keep serving
            assert read_blocks(t, cid, h, [0], first=int(cid[1:]), job=1000 + j) == [block(int(cid[1:]))]
        for cid in list(stored)[:4]:
            t.submit_delete(cid)
        t.close()  # drains the deletes
        u = NVMeStore(nvme_section(root, io_engine=engine), StoreContext(NS, 0, BLOCK))
        h = write_chunk(u, "again", 100, 1)
        assert read_blocks(u, "again", h, [0], first=100) == [block(100)]
        u.close()


def test_read_only_filesystem_refuses_puts(tmp_path: Path, caplog) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    t = NVMeStore(nvme_section(root), StoreContext(NS, 0, BLOCK))
    h = write_chunk(t, "one", 1, 1)
    with mounted(
        root, ["mount", "--bind", str(root), str(root)], ["mount", "-o", "remount,bind,ro", str(root)]
    ):
        with caplog.at_level(logging.WARNING):
            r = submit_chunk(t, "two", 2, 1, job=2)
        assert not r.ok and r.reason is FailureReason.READ_ONLY
        assert "Read-only file system" in caplog.text and "read_only" in caplog.text
        assert read_blocks(t, "one", h, [0], first=1) == [block(1)]
        t.close()


def test_file_size_limit_refuses_puts(tmp_path: Path) -> None:
    """EFBIG from RLIMIT_FSIZE, in a subprocess so the limit cannot touch pytest."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, time
        from vllm_kvtier.tiers.buffers import WriteBuffer
        from vllm_kvtier.config.lower import NVMeTierConfig
        from vllm_kvtier.tiers.nvme.store import NVMeStore
        from vllm_kvtier.tiers.registry import StoreContext
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        section = NVMeTierConfig(path=sys.argv[1], capacity_bytes=1 << 30, io_threads=2, chunk_blocks=256)
        t = NVMeStore(section, StoreContext("ns", 0, {BLOCK}))
        def result(job):
            while True:
                for r in t.poll():
                    if r.job_id == job:
                        return r
                t.wait(0.01)
        def put(job, k):
            wb = WriteBuffer([k], {BLOCK})
            assert t.submit_write(job, k.hex()[:16], wb)
            return result(job)
        ok = put(1, b"k" * 32)
        assert ok.ok
        resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE} // 2, resource.RLIM_INFINITY))
        r = put(2, b"j" * 32)
        print("PUT", r.ok, r.reason)
        t.submit_read(3, ok.chunk_id, ok.header, [0], [b"k" * 32])
        g = result(3)
        print("GET", g.ok and g.blocks[0].tobytes() == bytes({BLOCK}))
        g.release()
        t.close()
    """)
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "PUT False os_error" in r.stdout and "GET True" in r.stdout
    assert "File too large" in r.stderr and "write of" in r.stderr


# ---- I/O engines ---------------------------------------------------------------------------


@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize(("writer", "reader"), [("posix", "nixl"), ("nixl", "posix")])
def test_engines_read_each_others_chunks(tmp_path: Path, writer: str, reader: str, direct_io: str) -> None:
    # One engine at a time per directory (its lock): the writer closes, the reader opens.
    w = NVMeStore(nvme_section(tmp_path, direct_io=direct_io, io_engine=writer),
                  StoreContext(NS, 0, BLOCK))
    try:
        h = write_chunk(w, "mine", 0, 5)
    finally:
        w.close()
    other = NVMeStore(nvme_section(tmp_path, direct_io=direct_io, io_engine=reader),
                      StoreContext(NS, 0, BLOCK))
    try:
        assert write_chunk(other, "theirs", 0, 5) == h
        # The same chunk written by either engine: the same bytes on disk.
        assert other.path("mine").read_bytes() == other.path("theirs").read_bytes()
        assert len(other.path("mine").read_bytes()) == h.total_bytes
        # A subset of its blocks, out of order, read back by the other engine.
        assert read_blocks(other, "mine", h, [3, 1, 4]) == [block(3), block(1), block(4)]
    finally:
        other.close()
    # A store reopened with the other engine finds and serves what the first one stored.
    t = NVMeStore(nvme_section(tmp_path / "tier", io_engine=writer, direct_io=direct_io),
                  StoreContext(NS, 0, BLOCK))
    write_chunk(t, "seven", 7, 1)
    t.close()
    u = NVMeStore(nvme_section(tmp_path / "tier", io_engine=reader, direct_io=direct_io),
                  StoreContext(NS, 0, BLOCK))
    found = u.scan(cleanup=True).found
    assert read_blocks(u, "seven", found["seven"], [0], first=7) == [block(7)]
    u.close()


@pytest.mark.nixl
@requires_nixl
def test_damaged_block_read_through_nixl_is_a_miss(tmp_path: Path) -> None:
    t = NVMeStore(nvme_section(tmp_path, io_engine="nixl"), StoreContext(NS, 0, BLOCK))
    h1 = write_chunk(t, "one", 1, 1, job=1)
    h2 = write_chunk(t, "two", 2, 1, job=2)
    with open(t.path("one"), "r+b") as f:  # one bit of the block flipped, through the filesystem
        f.seek(h1.block_offset(0) + 17)
        b = f.read(1)
        f.seek(h1.block_offset(0) + 17)
        f.write(bytes([b[0] ^ 0x01]))
    got = read_blocks(t, "one", h1, [0], first=1)
    assert got is FailureReason.CHECKSUM and got.damaged
    assert read_blocks(t, "two", h2, [0], first=2) == [block(2)]
    t.close()


def test_io_engine_errors_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nixl_env: None) -> None:
    with pytest.raises(ConfigError, match="'posix', 'nixl', 'nixl-gds'") as e:
        NVMeStore(nvme_section(tmp_path, io_engine="spdk"), StoreContext(NS, 0, BLOCK))
    assert e.value.field == "nvme.io_engine"
    if HAVE_NIXL:  # GDS needs CUDA and libcufile: where its plugin does not load, start-up says so
        try:
            NVMeStore(nvme_section(tmp_path, io_engine="nixl-gds"),
                      StoreContext(NS, 0, BLOCK)).close()  # it loads here
        except ConfigError as err:
            assert err.field == "nvme.io_engine" and "GDS plugin, which does not load here" in str(err)
    # No nixl package: the install hint.
    for m in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, m, None)
    with pytest.raises(ConfigError, match="pip install nixl-cu12") as e:
        NVMeStore(nvme_section(tmp_path, io_engine="nixl"), StoreContext(NS, 0, BLOCK))
    assert e.value.field == "nvme.io_engine"


# ---- directories: private, checked, locked (issue 13), other namespaces (issue 14) -------------


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_created_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    with umask(0):  # a permissive umask: every bit the code asks for is kept
        t = NVMeStore(nvme_section(tmp_path / "a" / "b"), StoreContext(NS, 0, BLOCK))
        write_chunk(t, "one", 1, 2)
        t.close()
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / NS, t.dir):
        assert mode(d) == 0o700, d
    assert mode(t.path("one")) == 0o600
    assert mode(t.dir / LOCK_NAME) == 0o600
    with umask(0o077):  # a strict one changes nothing either
        t = NVMeStore(nvme_section(tmp_path / "c"), StoreContext(NS, 0, BLOCK))
        write_chunk(t, "two", 1, 1)
        t.close()
    assert mode(t.dir) == 0o700 and mode(t.path("two")) == 0o600


@pytest.mark.parametrize("which", ["rank", "namespace"])
def test_group_or_other_writable_directory_is_refused_and_left_alone(tmp_path: Path, which: str) -> None:
    t = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    write_chunk(t, "one", 1, 1)
    t.close()
    planted = t.dir / ".tmp-someones-12345678"
    planted.write_bytes(b"x")
    target = t.dir if which == "rank" else t.dir.parent
    os.chmod(target, 0o770)
    with pytest.raises(UnsafeDirectory, match="writable by group or others") as e:
        NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    assert str(target) in str(e.value)
    assert planted.exists() and t.path("one").exists() and mode(target) == 0o770  # nothing touched


def test_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to another user")
    t = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    t.close()
    os.chown(t.dir, 65534, 65534)  # nobody: e.g. a local user who pre-created it to plant chunks
    with pytest.raises(UnsafeDirectory, match="owned by uid 65534"):
        NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    os.chown(tmp_path, 65534, 65534)  # a base path of another (non-root) user
    os.chown(t.dir, 0, 0)
    with pytest.raises(UnsafeDirectory, match="nvme.path is owned by uid 65534"):
        NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))


def test_symlinks_resolved_in_the_base_path_refused_below_it(tmp_path: Path) -> None:
    real = tmp_path / "data"
    real.mkdir(mode=0o755)
    (tmp_path / "mnt").symlink_to(real)  # an operator's /mnt/nvme -> /data/nvme: accepted
    t = NVMeStore(nvme_section(tmp_path / "mnt"), StoreContext(NS, 0, BLOCK))
    write_chunk(t, "one", 1, 1)
    t.close()
    assert (real / NS / "r0" / "one.kvt").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (real / "0123456789abcdef").symlink_to(elsewhere)  # a namespace directory that is a link
    with pytest.raises(UnsafeDirectory, match="symlink"):
        NVMeStore(nvme_section(real), StoreContext("0123456789abcdef", 0, BLOCK))
    assert list(elsewhere.iterdir()) == []


def test_world_writable_base_needs_the_sticky_bit(tmp_path: Path) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o777)
    with pytest.raises(UnsafeDirectory, match="without the sticky bit"):
        NVMeStore(nvme_section(base), StoreContext(NS, 0, BLOCK))
    assert list(base.iterdir()) == []
    os.chmod(base, 0o1777)  # like /tmp: nobody else can rename what we create there
    NVMeStore(nvme_section(base), StoreContext(NS, 0, BLOCK)).close()


def test_second_store_on_a_locked_directory_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    """Reproduced bug: a second engine's start-up scan deleted the first one's in-flight
    tmp writes. Now its store is refused before it touches anything."""
    a = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    h = write_chunk(a, "one", 1, 2)
    in_flight = a.dir / ".tmp-two-0badf00d"  # a write of the first store, not renamed yet
    in_flight.write_bytes(b"\0" * 100)
    before = {p.name: p.stat().st_mtime_ns for p in a.dir.iterdir()}
    assert lock_holder(a.dir) is not None and f"pid {os.getpid()}" in lock_holder(a.dir)  # type: ignore[operator]
    with pytest.raises(DirectoryLocked, match=f"held by another engine \\(pid {os.getpid()} host"):
        NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    assert {p.name: p.stat().st_mtime_ns for p in a.dir.iterdir()} == before
    assert read_blocks(a, "one", h, [0, 1], first=1) == [block(1), block(2)]
    a.close()
    assert lock_holder(a.dir) is None  # released with the store
    b = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    assert set(b.scan(cleanup=True).found) == {"one"} and not in_flight.exists()  # now it is ours to clean
    b.close()


def test_other_namespaces_are_reported_and_collected_only_when_free_and_ours(tmp_path: Path) -> None:
    own, old, live, odd = "0" * 16, "1" * 16, "2" * 16, "3" * 16
    mine = NVMeStore(nvme_section(tmp_path), StoreContext(own, 0, BLOCK))
    for ns in (old, live, odd):
        for r in (0, 1):
            t = NVMeStore(nvme_section(tmp_path), StoreContext(ns, r, BLOCK))
            write_chunk(t, f"c{r}", r, 2)
            t.close()
    (tmp_path / odd / "r0" / "readme").write_text("someone else's")  # a file this tier never writes
    (tmp_path / "not-a-namespace").mkdir()
    holder = NVMeStore(nvme_section(tmp_path),
                       StoreContext(live, 1, BLOCK))  # a live engine on that namespace
    try:
        found = {f.path.name: f for f in foreign_namespaces(tmp_path, {own})}
        assert set(found) == {old, live, odd}
        assert found[old].files == 4 and found[old].nbytes == 2 * FILE_2 + 2 * len(
            (tmp_path / old / "r0" / LOCK_NAME).read_bytes())
        assert found[old].newest_age_s is not None and found[old].newest_age_s < 60
        assert found[old].keep_reason == ""
        assert "held by a live engine" in found[live].keep_reason
        assert "never writes (readme)" in found[odd].keep_reason
        assert collect_namespace(found[live]) == 0 and collect_namespace(found[odd]) == 0
        assert collect_namespace(found[old]) > 0
        assert not (tmp_path / old).exists()
        assert (tmp_path / live / "r0" / "c0.kvt").exists() and (tmp_path / odd / "r1" / "c1.kvt").exists()
        assert (tmp_path / "not-a-namespace").exists() and mine.dir.exists()
    finally:
        holder.close()
        mine.close()


def test_an_engine_starting_while_its_namespace_is_collected_waits_and_gets_its_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproduced bug: a collection holds every rank lock while it deletes the namespace's
    files (seconds for a large one); an engine starting on that namespace meanwhile gave up
    after 0.2 s and ran without its NVMe tier. It now waits for the collector, then creates
    the directory again and holds its lock."""
    import threading

    old = "1" * 16
    t = NVMeStore(nvme_section(tmp_path), StoreContext(old, 0, BLOCK))
    write_chunk(t, "c0", 0, 2)
    t.close()
    (found,) = foreign_namespaces(tmp_path, {"0" * 16})
    collecting, go_on = threading.Event(), threading.Event()
    real_unlink = os.unlink

    def slow_unlink(path: object, *a: object, **kw: object) -> None:
        if str(path).endswith(".kvt") and not go_on.is_set():
            collecting.set()
            go_on.wait(60)  # the collection takes as long as the test says
        real_unlink(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", slow_unlink)
    freed: list[int] = []
    collector = threading.Thread(target=lambda: freed.append(collect_namespace(found)))
    collector.start()
    assert collecting.wait(60)
    opened: list[object] = []
    starter = threading.Thread(target=lambda: opened.append(_try_open(tmp_path, old)))
    starter.start()
    starter.join(1.0)  # 5 times the old retry window: it had given up by now
    go_on.set()
    collector.join(60)
    starter.join(60)
    assert freed and freed[0] > 0
    (got,) = opened
    assert isinstance(got, NVMeStore), got
    try:
        assert got.dir.is_dir() and not list(got.dir.glob("*.kvt"))  # a fresh directory, and it is ours
        assert f"pid {os.getpid()}" in (lock_holder(got.dir) or "")
    finally:
        got.close()


def _try_open(root: Path, ns: str) -> object:
    try:
        return NVMeStore(nvme_section(root), StoreContext(ns, 0, BLOCK))
    except OSError as e:
        return e


@pytest.mark.parametrize("err", [24, 5, 13])  # EMFILE, EIO, EACCES
def test_owner_scan_keeps_a_chunk_it_could_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    err: int) -> None:
    """A transient error while the owner's start-up scan opens a chunk (out of file
    descriptors, an I/O error, a permission) says nothing about its bytes: the file is
    skipped and counted, not deleted; a damaged file (bad magic) still is, and the next
    scan finds the kept one."""
    import vllm_kvtier.tiers.nvme.store as nvme_mod

    a = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    h = write_chunk(a, "good", 1, 1, job=1)
    write_chunk(a, "bad", 2, 1, job=2)
    a.close()
    with open(a.path("bad"), "r+b") as f:
        f.write(b"XXXX")  # bad magic
    real = nvme_mod._open_regular

    def flaky(path: Path, flags: int) -> int:
        if Path(path).name.startswith("good"):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, flags)

    monkeypatch.setattr(nvme_mod, "_open_regular", flaky)
    b = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, BLOCK))
    res = b.scan(cleanup=True)
    assert res.found == {} and res.problems == {"unreadable_kept": 1, "format": 1}
    assert a.path("good").exists() and not a.path("bad").exists()
    monkeypatch.setattr(nvme_mod, "_open_regular", real)
    assert b.scan(cleanup=True).found == {"good": h}
    b.close()
