"""flashinfer's paged decode, checked on CPU against a stand-in module: it is chosen only for
head dims it has kernels for, tensor cores for GQA groups the plain kernel lacks, a zeroed
workspace, and `plan` gets host index tensors."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from easerve.engine import attention as att
from easerve.engine.block_manager import BlockManager
from easerve.engine.kv_pool import KVLayout, PagedKVPool


def test_head_dim_decides_eligibility() -> None:
    for d in (64, 128, 256):
        assert att.paged_kernel_available("cuda", torch.bfloat16, True, head_dim=d)
    for d in (16, 80, 96):  # the tiny test models have 16
        assert not att.paged_kernel_available("cuda", torch.bfloat16, True, head_dim=d)


@pytest.mark.parametrize("heads,kv_heads,tc", [(28, 4, True), (32, 4, False), (12, 2, False), (20, 4, True),
                                               (16, 16, False), (40, 4, True)])
def test_gqa_group_picks_tensor_cores(heads: int, kv_heads: int, tc: bool) -> None:
    assert att.flashinfer_tensor_cores(heads, kv_heads) is tc  # Qwen2.5-VL-7B: 28/4 = 7 -> True
    with pytest.raises(ValueError, match="not a multiple"):
        att.flashinfer_tensor_cores(30, 4)


class FakeFlashinfer:
    def __init__(self) -> None:
        self.made: list = []

    def BatchDecodeWithPagedKVCacheWrapper(self, workspace, layout, use_tensor_cores=False):
        self.made.append((workspace.clone(), layout, use_tensor_cores))
        return NS()


def test_wrapper_gets_a_zeroed_workspace_and_tensor_cores_for_group_7() -> None:
    fi = FakeFlashinfer()
    for _ in range(20):  # leave dirty freed blocks of the workspace's size for the allocator to reuse
        dirty = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)
        del dirty
        att.flashinfer_decode_wrapper(fi, 28, 4, torch.device("cpu"), 1 << 16)
    assert all(int(ws.count_nonzero()) == 0 for ws, _, _ in fi.made)
    assert fi.made[0][1:] == ("NHD", True)


class PlanRecorder:
    def __init__(self) -> None:
        self.planned: list = []

    def plan(self, indptr, indices, last_len, *args, **kwargs) -> None:
        self.planned.append((indptr, indices, last_len, args))

    def run(self, q, kv):
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)


def test_plan_gets_host_index_tensors_once_per_step() -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float16, device=torch.device("cpu"))
    pool = PagedKVPool(layout, BlockManager(8, 4))
    rec = PlanRecorder()
    step = att.FlashInferStepCache(pool, rec, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                   ((0, 1), (2,)), (5, 2))
    query = torch.empty(2, 8, 1, 64, dtype=torch.float16, device="meta")  # device memory stand-in
    for layer in range(2):
        out, _ = step.attend(NS(layer_idx=layer), query, None, None)
        assert out.shape == (2, 1, 8, 64)
    assert len(rec.planned) == 1
    indptr, indices, last_len, args = rec.planned[0]
    assert all(t.device.type == "cpu" for t in (indptr, indices, last_len))
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [0, 1, 2] and last_len.tolist() == [2, 3]
    assert args[:4] == (8, 2, 64, 4)
