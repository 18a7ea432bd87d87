"""TensorGroup / TensorGroupProcessor: base switch, storage dedup, as_strided rebuild."""

from __future__ import annotations

import pytest
import torch

from annotate_offload.runtime import TensorGroup, TensorGroupProcessor


def _roundtrip(tensors, events=None):
    group = TensorGroup(list(tensors), events or [None] * len(tensors))
    units, aux = TensorGroupProcessor.tensor_group_process_before_offload(group)
    reloaded = TensorGroup([u.clone() for u in units.tensor_list], units.events, aux)
    return units, TensorGroupProcessor.tensor_group_process_after_reload(reloaded)


def test_views_of_one_storage_collapse_to_one_unit():
    x = torch.randn(4, 6, 8)
    tensors = [x, x.transpose(1, 2), x[:, :3], x.view(24, 8)]
    units, back = _roundtrip(tensors)
    assert len(units.tensor_list) == 1 and units.tensor_list[0].numel() == x.nbytes
    for orig, new in zip(tensors, back.tensor_list):
        assert torch.equal(orig, new)
        assert orig.stride() == new.stride() and orig.storage_offset() == new.storage_offset()
    # rebuilt views share one reloaded buffer
    assert len({t.untyped_storage()._cdata for t in back.tensor_list}) == 1


def test_interleaved_qkv_offload_base_tensor():
    qkv = torch.randn(2, 5, 3, 4, 8)
    q, k, v = qkv.unbind(2)
    for t in (q, k, v):
        t.offload_base_tensor = True
    units, back = _roundtrip([q, k, v])
    assert len(units.tensor_list) == 1
    for a, b in zip((q, k, v), back.tensor_list):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_expanded_tensor_is_never_materialised():
    v = torch.randn(1, 4096)
    e = v.expand(64, 4096)
    units, back = _roundtrip([e])
    assert units.tensor_list[0].numel() == v.nbytes  # 16 KiB, not 1 MiB
    assert back.tensor_list[0].stride() == (0, 1) and torch.equal(back.tensor_list[0], e)


def test_small_view_of_large_storage_moves_only_its_span():
    x = torch.randn(1000, 100)
    s = x[10:12]
    units, back = _roundtrip([s])
    assert units.tensor_list[0].numel() == s.nbytes
    assert torch.equal(back.tensor_list[0], s)


def test_distinct_storages_stay_distinct_and_latest_event_wins():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    units, back = _roundtrip([a, b, a.t()], events=["ea", "eb", "ea2"])
    assert len(units.tensor_list) == 2
    assert units.events == ["ea2", "eb"]  # an aliased unit waits for its latest ready event
    assert torch.equal(back.tensor_list[2], a.t())


def test_after_reload_without_aux_raises():
    with pytest.raises(ValueError, match="group.aux is None"):
        TensorGroupProcessor.tensor_group_process_after_reload(TensorGroup([torch.zeros(1)]))
