"""Throughput of the CPU tier's copy engine against a plain torch copy of the same bytes.

What it measures, in one run, interleaved (ours then the reference, repeat after repeat):

* ``save``: blocks of vLLM's KV tensors -> the CPU pool (``CopyEngine.submit("save")``);
* ``load``: the CPU pool -> other blocks of the KV tensors (``submit("load")``);

each for ``--blocks`` blocks with consecutive block ids (a few large copies) and with
scattered ids (``--scatter`` = fraction of blocks that start a new run of consecutive ids;
1.0 = every block on its own, i.e. one copy per block and plane).

The reference is what the hardware gives for the same number of bytes in one call:
``dst.copy_(src)`` between two contiguous tensors of exactly that size on the same device
pair (on CUDA: pinned host memory, ``non_blocking=True`` + synchronize, i.e. one
``cudaMemcpyAsync``). The ratio ours / reference is the efficiency of the data path.

Correctness is checked too: random bytes are saved from blocks A and loaded into blocks
B; every layer's B blocks must equal its A blocks byte for byte and no other block may
change. A mismatch exits non-zero.

    python bench/cpu_tier_throughput.py                    # vLLM CPU layout, on CPU
    python bench/cpu_tier_throughput.py --device cuda      # FlashAttention layout, GPU<->pinned

On CPU, ``copy_`` of a large tensor is split over torch's OpenMP threads, so every copy is
a parallel region. On a small VM (2 vCPUs) spinning idle OpenMP threads were seen to slow
many back-to-back copies (ours: one per plane and run) far more than one big copy, with
occasional stalls of seconds; ``OMP_WAIT_POLICY=PASSIVE`` or ``--threads 1`` gave stable
numbers there. The JSON records these settings and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_kvtier.tiers.cpu import CPUPool  # noqa: E402
from vllm_kvtier.transfer.copier import make_copy_engine  # noqa: E402
from vllm_kvtier.transfer.layout import build_layout, runs  # noqa: E402

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layout", choices=["cpu", "flash"], default=None,
                   help="cpu: [num_blocks, kv_heads, block_size, 2*head_size] per layer; "
                        "flash: [2, num_blocks, block_size, kv_heads, head_size] per layer "
                        "(default: cpu on --device cpu, flash on --device cuda)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: 32 on cpu, 16 on cuda, as vLLM's defaults)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--blocks", type=int, default=None,
                   help="blocks per transfer (default: 128 on cpu, 256 on cuda)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="blocks in the fake KV cache (default: 4 x --blocks + 1)")
    p.add_argument("--scatter", type=float, default=0.5,
                   help="scattered case: fraction of blocks that start a new run of "
                        "consecutive ids (1.0 = no two blocks adjacent)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop the timed loop after this long (at least one timed repeat "
                        "runs), so a stalling machine cannot make the run endless")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for both ours and the reference (CPU copies "
                        "are parallelised over these threads; default: torch's default)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "cpu_tier_throughput.json"))
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if a.layout is None:
        a.layout = "flash" if cuda else "cpu"
    if a.block_size is None:
        a.block_size = 16 if cuda else 32
    if a.blocks is None:
        a.blocks = 256 if cuda else 128
    if a.num_blocks is None:
        a.num_blocks = 4 * a.blocks + 1  # odd: never equal to a head/block dimension
    if a.num_blocks < 4 * a.blocks:
        p.error("--num-blocks must be at least 4 x --blocks (source and destination halves)")
    if not 0.0 <= a.scatter <= 1.0:
        p.error("--scatter must be in [0, 1]")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return a


# ---- fake KV cache ------------------------------------------------------------------


def make_kv(a: argparse.Namespace, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """Per-layer KV tensors in vLLM's layout; returns (tensors, block dimension)."""
    dtype = getattr(torch, a.dtype)
    if a.layout == "cpu":
        shape = (a.num_blocks, a.kv_heads, a.block_size, 2 * a.head_size)
        bdim = 0
    else:
        shape = (2, a.num_blocks, a.block_size, a.kv_heads, a.head_size)
        bdim = 1
    kv = {f"model.layers.{i}.self_attn.attn": torch.empty(shape, dtype=dtype, device=device)
          for i in range(a.layers)}
    return kv, bdim


def fill_random(kv: dict[str, torch.Tensor], gen_seed: int) -> None:
    g = torch.Generator(device=next(iter(kv.values())).device)
    g.manual_seed(gen_seed)
    for t in kv.values():
        b = t.view(torch.uint8)
        if b.shape[-1] % 8 == 0:  # 8 random bytes per element: much faster on CPU
            b.view(torch.int64).random_(generator=g)
        else:
            b.random_(0, 256, generator=g)


# ---- block ids ----------------------------------------------------------------------


def scattered_ids(rng: random.Random, base: int, space: int, n: int, frac: float) -> list[int]:
    """``n`` distinct ids in ``[base, base + space)`` forming ``round(frac * n)`` runs of
    consecutive ids, the runs separated by gaps and listed in random order."""
    r = max(1, min(n, round(frac * n)))
    free = space - n
    if free < r - 1:
        raise ValueError("id space too small for that many runs")
    cuts = sorted(rng.sample(range(1, n), r - 1))  # run lengths >= 1
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    extra = free - (r - 1)  # spread over r + 1 gaps; interior gaps get +1 so runs never merge
    bars = sorted(rng.randint(0, extra) for _ in range(r))
    gaps = [b - a for a, b in zip([0, *bars], [*bars, extra], strict=True)]
    out_runs, pos = [], base + gaps[0]
    for i, ln in enumerate(lengths):
        out_runs.append(list(range(pos, pos + ln)))
        pos += ln + 1 + gaps[i + 1]
    rng.shuffle(out_runs)
    ids = [b for run in out_runs for b in run]
    assert len(set(ids)) == n and min(ids) >= base and max(ids) < base + space
    return ids


# ---- timing -------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(engine, direction: str, blocks: list[int], slots: list[int],
              device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    t = engine.submit(direction, blocks, slots, background=False)
    t.wait()
    sync(device)
    return time.perf_counter() - t0


def time_ref(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=device.type == "cuda")
    sync(device)
    return time.perf_counter() - t0


# ---- correctness --------------------------------------------------------------------


def check_roundtrip(engine, kv: dict[str, torch.Tensor], bdim: int, src: list[int],
                    dst: list[int], slots: list[int], device: torch.device,
                    label: str) -> None:
    """Save ``src`` -> slots, load slots -> ``dst``; dst must equal src, nothing else changes.

    The KV tensors must hold random bytes (distinct blocks) when this is called."""
    engine.submit("save", src, slots, background=False).wait()
    sync(device)
    lead = (slice(None),) * bdim  # advanced indexing: index_select on uint8 is slow on CPU
    at_src = (*lead, torch.tensor(src, device=device))
    at_dst = (*lead, torch.tensor(dst, device=device))
    saved = {name: t.view(torch.uint8)[at_src] for name, t in kv.items()}
    # Change every byte of the KV cache: the load must come from the pool, not the KV.
    for t in kv.values():
        t.view(torch.uint8).add_(1)
    sync(device)
    expected = {}
    for name, t in kv.items():
        e = t.view(torch.uint8).clone()
        e[at_dst] = saved[name]
        expected[name] = e
    del saved
    engine.submit("load", dst, slots, background=False).wait()
    sync(device)
    for name, t in kv.items():
        got = t.view(torch.uint8)
        if not torch.equal(got, expected[name]):
            bad = (got != expected[name]).nonzero()
            raise SystemExit(
                f"CORRECTNESS FAILURE ({label}): layer {name}: {bad.shape[0]} bytes differ after "
                f"save {len(src)} blocks -> pool -> load into other blocks; first at index "
                f"{bad[0].tolist()}"
            )
    del expected


# ---- machine info -------------------------------------------------------------------


def machine_info(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "cpu_model": _cpu_model(),
        "hostname": platform.node(),
        # Copies on CPU run on torch's OpenMP threads; how idle threads wait changes the
        # numbers a lot on small VMs (see the module docstring).
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                               "GOMP_SPINCOUNT", "KMP_BLOCKTIME")},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_bytes"] = props.total_memory
    else:
        info["device_name"] = f"cpu ({info['cpu_model']})"
    try:
        import vllm  # noqa: F401

        info["vllm"] = getattr(vllm, "__version__", "?")
    except Exception:  # the bench does not need vLLM
        info["vllm"] = None
    return info


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---- main ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    load_before = _loadavg()
    rng = random.Random(a.seed)
    pin = device.type == "cuda"

    kv, bdim = make_kv(a, device)
    layout = build_layout(kv, a.num_blocks)
    n = a.blocks
    nbytes = layout.block_bytes * n
    pool = CPUPool(n, layout.plane_bytes, pin=pin, prefault=True)
    engine = make_copy_engine(layout, pool)

    # Reference buffers: exactly nbytes, contiguous, same device pair (pinned host on CUDA).
    ref_dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    ref_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)

    kv_bytes = sum(t.numel() * t.element_size() for t in kv.values())
    host_bytes = pool.nbytes + ref_host.numel() + (kv_bytes + ref_dev.numel() if device.type == "cpu" else 0)
    print(f"device {device} | layout {a.layout}: {layout.description} | {len(layout.planes)} planes")
    print(f"block {layout.block_bytes / 2**10:.0f} KiB (all layers) | {n} blocks/transfer = "
          f"{nbytes / 2**20:.1f} MiB | KV cache {a.num_blocks} blocks = {kv_bytes / 2**20:.0f} MiB | "
          f"host memory used ~{host_bytes / 2**30:.2f} GiB | pool pinned={pool.pinned}")

    # Block ids: sources in the lower half, destinations in the upper half.
    half = a.num_blocks // 2
    slots = list(range(n))
    ids = {
        "consecutive": (list(range(0, n)), list(range(half, half + n))),
        "scattered": (scattered_ids(rng, 0, half, n, a.scatter),
                      scattered_ids(rng, half, half, n, a.scatter)),
    }
    copies = {k: len(runs(s, slots)) for k, (s, _d) in ids.items()}
    print(f"copies per plane: consecutive save {copies['consecutive']}, scattered save "
          f"{copies['scattered']} (--scatter {a.scatter}); x{len(layout.planes)} planes")

    # Correctness first (fail fast), on random bytes.
    t_phase = time.perf_counter()
    fill_random(kv, a.seed)
    for case, (src, dst) in ids.items():
        check_roundtrip(engine, kv, bdim, src, dst, slots, device, case)
    t_check = time.perf_counter() - t_phase
    print("correctness: save -> pool -> load into other blocks: bytes equal (consecutive, scattered)")

    # Timed, interleaved: for each repeat, each case runs ours then the reference (the
    # order flips every repeat so neither always runs on a warmer cache).
    cases = []
    for pattern, (src, dst) in ids.items():
        cases.append((f"save/{pattern}", "save", src, ref_host, ref_dev))
        cases.append((f"load/{pattern}", "load", dst, ref_dev, ref_host))
    times: dict[str, dict[str, list[float]]] = {c[0]: {"ours": [], "ref": []} for c in cases}
    t_phase = time.perf_counter()
    for rep in range(a.warmup + a.repeats):
        for name, direction, blocks, rdst, rsrc in cases:
            runs_ = [("ours", lambda d=direction, b=blocks: time_ours(engine, d, b, slots, device)),
                     ("ref", lambda x=rdst, y=rsrc: time_ref(x, y, device))]
            if rep % 2:
                runs_.reverse()
            for who, fn in runs_:
                dt = fn()
                if rep >= a.warmup:
                    times[name][who].append(dt)
        if rep >= a.warmup and time.perf_counter() - t_phase > a.max_seconds:
            break
    repeats_done = len(times[cases[0][0]]["ours"])
    if repeats_done < a.repeats:
        print(f"note: timed loop stopped after {repeats_done} of {a.repeats} repeats "
              f"(--max-seconds {a.max_seconds:g})")

    t_timed = time.perf_counter() - t_phase
    # Correctness again after the timed loop (nothing in it may have corrupted the path).
    t_phase = time.perf_counter()
    fill_random(kv, a.seed + 1)
    for case, (src, dst) in ids.items():
        check_roundtrip(engine, kv, bdim, src, dst, slots, device, case)
    t_check += time.perf_counter() - t_phase
    engine.shutdown()

    results = []
    hdr = f"{'case':<18} {'bytes':>12} {'ours GB/s':>10} {'ref GB/s':>10} {'ratio':>7}"
    print()
    print(hdr)
    print("-" * len(hdr))
    for name, _d, _b, _x, _y in cases:
        med_ours = statistics.median(times[name]["ours"])
        med_ref = statistics.median(times[name]["ref"])
        ours_gbs = nbytes / med_ours / GB
        ref_gbs = nbytes / med_ref / GB
        ratio = ours_gbs / ref_gbs
        pattern = name.split("/")[1]
        results.append({
            "case": name, "bytes": nbytes, "blocks": n,
            "copies_per_plane": copies[pattern],
            "ours_gbps": ours_gbs, "ref_gbps": ref_gbs, "ratio": ratio,
            "ours_median_s": med_ours, "ref_median_s": med_ref,
            "ours_s": times[name]["ours"], "ref_s": times[name]["ref"],
        })
        print(f"{name:<18} {nbytes:>12} {ours_gbs:>10.2f} {ref_gbs:>10.2f} {ratio:>7.2f}")
    print("target: ratio >= 0.8")
    worst = min(r["ratio"] for r in results)
    total_s = time.perf_counter() - t_start
    print(f"worst ratio {worst:.2f} ({'meets' if worst >= 0.8 else 'BELOW'} target) | "
          f"{repeats_done} repeats + {a.warmup} warmup, medians | torch threads "
          f"{torch.get_num_threads()} | correctness {t_check:.1f} s, timed {t_timed:.1f} s, "
          f"total {total_s:.1f} s")
    load_after = _loadavg()
    if load_before:
        print(f"loadavg before: {load_before} | after: {load_after} (other load on the machine "
              "makes CPU numbers noisy)")

    out = {
        "benchmark": "cpu_tier_throughput",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": vars(a),
        "layout": {
            "description": layout.description, "planes": len(layout.planes),
            "plane_bytes": list(layout.plane_bytes)[:4] + (["..."] if len(layout.planes) > 4 else []),
            "block_bytes": layout.block_bytes, "num_blocks": layout.num_blocks,
            "kv_bytes": kv_bytes, "pool_bytes": pool.nbytes, "pool_pinned": pool.pinned,
        },
        "block_ids": {k: {"src": s, "dst": d} for k, (s, d) in ids.items()},
        "correctness": "ok",
        "repeats_done": repeats_done,
        "target_ratio": 0.8,
        "worst_ratio": worst,
        "meets_target": worst >= 0.8,
        "results": results,
        "machine": {**machine_info(device), "loadavg_before": load_before,
                    "loadavg_after": load_after},
        "phase_s": {"correctness": t_check, "timed": t_timed, "total": total_s},
    }
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
