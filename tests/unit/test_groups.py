"""Hybrid-model units (``index/groups.py``): group keys, the sliding-window arithmetic,
the hit rule within a sliding group, the save filter; the namespace of a single-group
model unchanged; shared KV tensors laid out once; refusals at start with real vLLM specs."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.wiring import group_layout
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.index.groups import (
    GroupKeys,
    GroupLayout,
    GroupSpec,
    KeyOrigins,
    SaveFilter,
    group_key,
    sliding_hit,
    window_start,
)
from vllm_kvtier.keys import NamespaceFields, namespace
from vllm_kvtier.transfer.layout import build_layout

BS = 32


def test_group_zero_keeps_the_hash_and_other_groups_get_distinct_keys():
    h = bytes(range(32))
    assert group_key(h, 0) == h
    k1, k2 = group_key(h, 1), group_key(h, 2)
    assert len({h, k1, k2}) == 3 and len(k1) == 32
    assert group_key(h, 1) == k1  # stable
    with pytest.raises(ValueError):
        group_key(h, -1)


def test_window_start_matches_vllms_skipped_tokens():
    # vLLM skips max(0, n - window + 1) tokens of a request with n tokens computed.
    for window in (1, 31, 32, 33, 64, 100, 4096):
        for m in range(0, 40):
            skipped = max(0, m * BS - window + 1)
            assert window_start(m, window, BS) == skipped // BS
    assert window_start(10, 0, BS) == 0  # full attention reads everything
    assert window_start(10, 64, BS) == 8


def test_sliding_hit_is_the_longest_prefix_whose_window_is_present():
    spec = GroupSpec("sliding", BS, 64)
    present = [False] * 12
    for p in (2, 3, 8, 9):
        present[p] = True
    assert sliding_hit(present, 10, spec) == 10  # [8, 10)
    assert sliding_hit(present, 9, spec) == 4  # [7, 9) lacks 7; [2, 4) is there
    assert sliding_hit(present, 3, spec) == 0  # [1, 3) lacks 1
    assert sliding_hit(present, 3, spec, floor=2) == 3  # below the engine's own hit: present


def test_save_filter_keeps_the_windows_of_the_boundaries_only():
    spec = GroupSpec("sliding", BS, 64)
    f = SaveFilter(spec, num_prompt_tokens=10 * BS + 8, checkpoint_blocks=4)
    assert f.boundaries() == [4, 8, 10]
    assert [p for p in range(10) if f(p)] == [2, 3, 6, 7, 8, 9]
    assert f(12) and f(30)  # decode blocks while the request runs
    f.with_final(14)
    assert [p for p in range(10, 20) if f(p)] == [12, 13]
    # A prompt of exact blocks: its repeat boundary is one block shorter.
    g = SaveFilter(spec, num_prompt_tokens=10 * BS, checkpoint_blocks=0)
    assert g.boundaries() == [9, 10] and [p for p in range(10) if g(p)] == [7, 8, 9]


class _Req:
    def __init__(self, hashes):
        self.block_hashes = hashes


def test_group_keys_follow_the_live_request_and_record_their_origin():
    hashes = [bytes([i]) * 32 for i in range(3)]
    req = _Req(hashes)
    origins = KeyOrigins(max_entries=4)
    keys = GroupKeys(req, 1, origins)
    assert len(keys) == 3 and keys[1] == group_key(hashes[1], 1) and keys[-1] == group_key(hashes[2], 1)
    hashes.append(bytes([9]) * 32)  # vLLM appends a hash as a block completes
    assert keys[1:] == [group_key(h, 1) for h in hashes[1:]]
    assert origins.origin(keys[3]) == (hashes[3], 1)
    assert origins.origin(hashes[0]) == (hashes[0], 0)
    for i in range(10, 20):
        origins.note(bytes([i]), b"h", 1)
    assert len(origins) == 4  # bounded


def test_single_group_namespace_is_unchanged_and_the_group_layout_changes_it():
    base = dict(model="m", kv_dtype="torch.float32", block_size=32, num_layers=2, num_kv_heads=2, head_size=64,
                tp_size=1, tp_rank=0, layout="vllm-block-planes", hash_algo="sha256")
    assert namespace(NamespaceFields(**base)) == "1acf7515c0b75ef8"  # what release 0.1 computed
    layout = GroupLayout((GroupSpec("sliding", 32, 64), GroupSpec("full", 32)))
    assert layout.describe() == "sliding64:32:1,full:32:1"
    assert GroupLayout((GroupSpec("full", 32, 0, 2),)).describe() == ""
    assert namespace(NamespaceFields(**base, groups=layout.describe())) != "1acf7515c0b75ef8"


def test_layout_lays_a_tensor_shared_by_several_layers_out_once():
    t = torch.arange(8 * 2 * 4 * 6, dtype=torch.float32).reshape(8, 2, 4, 6)
    other = torch.zeros(8, 2, 4, 6)
    shared = build_layout({"model.layers.0.attn": t, "model.layers.1.attn": t[:], "model.layers.2.attn": other}, 8)
    assert shared.shared and len(shared.planes) == 2
    assert shared.block_bytes == 2 * 2 * 4 * 6 * 4
    assert not build_layout({"model.layers.0.attn": t, "model.layers.1.attn": other}, 8).shared


def _spec(cls=FullAttentionSpec, **kw):
    return cls(block_size=kw.pop("block_size", BS), num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


def _config(*groups):
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(groups)])


def test_group_layout_reads_vllms_specs():
    layout = group_layout(parse_config({}), _config(_spec(SlidingWindowSpec, sliding_window=64), _spec()))
    assert layout.hybrid and layout.sliding_groups == [0] and layout.full_groups == [1]
    assert layout.groups[0] == GroupSpec("sliding", BS, 64, 1)
    assert not group_layout(parse_config({}), _config(_spec())).hybrid


def test_state_space_layers_are_refused_naming_the_layer_type():
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    for cfg in (_config(_spec(), mamba), _config(mamba)):
        with pytest.raises(ConfigError) as e:
            group_layout(parse_config({}), cfg)
        msg = str(e.value)
        assert "MambaSpec" in msg and "model.layers." in msg and "OffloadingConnector" in msg


@pytest.mark.parametrize(("extra", "field"), [
    ({"nixl": {}}, "nixl"),
    ({"verify": {"sample_rate": 0.01}}, "verify.sample_rate"),
    ({"mooncake": {"master": "m:50051", "accept_handoffs": True}}, "mooncake.accept_handoffs"),
])
def test_hybrid_refuses_block_id_features(extra, field):
    with pytest.raises(ConfigError) as e:
        group_layout(parse_config(extra), _config(_spec(SlidingWindowSpec, sliding_window=64), _spec()))
    assert e.value.field == field and "--disable-hybrid-kv-cache-manager" in str(e.value)
    group_layout(parse_config(extra), _config(_spec()))  # one group: as before


def test_hybrid_refuses_mixed_block_sizes():
    with pytest.raises(ConfigError, match="different block sizes"):
        group_layout(parse_config({}), _config(_spec(SlidingWindowSpec, sliding_window=64, block_size=16), _spec()))


class _Live:
    request_id = "r1"
    num_prompt_tokens = 70
    kv_transfer_params = {"x": 1}

    def __init__(self):
        self.block_hashes = [bytes([i]) * 32 for i in range(2)]


def test_group_views_compose_with_the_live_request():
    from vllm_kvtier.engine.scheduler import GroupView, real_id, view_id

    live = _Live()
    v0, v1 = GroupView(live, 0), GroupView(live, 1)
    assert (v0.request_id, v1.request_id) == (view_id("r1", 0), view_id("r1", 1))
    assert real_id(v1.request_id) == "r1" and real_id("plain") == "plain"
    assert list(v0.block_hashes) == live.block_hashes  # group 0: the request's own keys
    assert list(v1.block_hashes) == [group_key(h, 1) for h in live.block_hashes]
    assert v1.num_prompt_tokens == 70 and v1.kv_transfer_params == {"x": 1}  # the rest is the live request's
    live.num_prompt_tokens = 71
    assert v1.num_prompt_tokens == 71


def test_a_plan_for_group_views_goes_to_the_workers_with_vllms_ids():
    from vllm_kvtier.engine.scheduler import to_real_ids, view_id
    from vllm_kvtier.jobs import ChunkRead, LoadJob, SaveJob, StepPlan

    a0, a1, b1 = view_id("a", 0), view_id("a", 1), view_id("b", 1)
    read = ChunkRead("nvme", "f1", (0,), (7,), (b"k7",))
    plan = StepPlan(
        num_slots=8,
        loads=[LoadJob(a0, (3,), (1,), (b"k1",), True), LoadJob(a1, (5, 6), (2, 7), (b"k2", b"k7"), True,
                                                                reads=(read,), unloadable=(9,))],
        saves_after=[SaveJob(b1, (4,), (3,), (b"k3",))],
        freed=[a0, a1, b1], preempted=[b1],
    )
    out = to_real_ids(plan)
    assert len(out.loads) == 1
    job = out.loads[0]
    assert (job.req_id, job.block_ids, job.slots, job.keys) == ("a", (3, 5, 6), (1, 2, 7), (b"k1", b"k2", b"k7"))
    assert job.asynchronous and job.reads == (read,) and job.unloadable == (9,)
    assert [j.req_id for j in out.saves_after] == ["b"]
    assert out.freed == ["a", "b"] and out.preempted == ["b"]
