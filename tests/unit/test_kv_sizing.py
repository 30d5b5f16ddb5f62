"""KV pool sizing from memory (EngineConfig.kv_geometry), the decode service's flags (its config is
the engine's), and the choice of attention backend."""
import pytest
import torch

from easerve.engine.attention import paged_kernel_available, paged_kv_indices, select_attention
from easerve.engine.config import DEFAULT_KV_TOKENS, GIB, EngineConfig, KVGeometry, default_cpu_kv_bytes, gpu_kv_budget
from easerve.engine.kv_pool import KVLayout
from easerve.stages.common.configs import DecodeConfig
from easerve.stages.common.argv import from_argv


def parse(argv):
    return from_argv(DecodeConfig, "decode", argv)

MIB = 1 << 20


def _layout(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16):
    return KVLayout(layers, kv_heads, head_dim, dtype, torch.device("cpu"))


def test_bytes_per_token_counts_layers_k_and_v_heads_dim_and_dtype():
    assert _layout().bytes_per_token == 32 * 2 * 8 * 128 * 2            # 128 KiB: an 8B GQA model in bf16
    assert _layout(dtype=torch.float32).bytes_per_token == 32 * 2 * 8 * 128 * 4


def test_memory_sized_slots_hold_what_fits_capped_at_max_running():
    per_token = _layout().bytes_per_token
    cfg = EngineConfig(max_running=64, kv_cache_memory_gb=2, max_seq_len=4096)
    g = cfg.kv_geometry(per_token)
    assert (g.layout, g.num_blocks, g.block_size, g.max_seq_tokens) == ("slots", 4, 4096, 4096)  # 16384 tokens
    small = EngineConfig(max_running=3, kv_cache_memory_gb=2, max_seq_len=1024).kv_geometry(per_token)
    assert small.num_blocks == 3   # 16 would fit, but at most max_running ever run


def test_memory_sized_paged_pool_in_blocks():
    per_token = _layout().bytes_per_token
    cfg = EngineConfig(max_running=64, kv_cache_memory_gb=1, max_seq_len=4096, kv_layout="paged")
    g = cfg.kv_geometry(per_token)
    assert (g.layout, g.num_blocks, g.block_size) == ("paged", 8192 // 16, 16)
    capped = EngineConfig(max_running=2, kv_cache_memory_gb=1, max_seq_len=100, kv_layout="paged")
    assert capped.kv_geometry(per_token).num_blocks == 2 * 7   # 2 requests of ceil(100 / 16) blocks
    # no max_seq_len: "auto" is paged (slots need a size), the pool is the whole budget
    g = EngineConfig(kv_cache_memory_gb=1).kv_geometry(per_token)
    assert g.layout == "paged" and g.max_seq_tokens is None and g.num_blocks == 512


def test_auto_layout_is_paged_where_a_paged_kernel_runs():
    cfg = EngineConfig(kv_cache_memory_gb=1, max_seq_len=512)
    assert cfg.kv_geometry(1024).layout == "slots"
    assert cfg.kv_geometry(1024, paged_kernel=True).layout == "paged"
    assert EngineConfig(kv_cache_memory_gb=1, max_seq_len=512, kv_layout="slots").kv_geometry(
        1024, paged_kernel=True).layout == "slots"


def test_too_little_memory_says_what_to_change():
    cfg = EngineConfig(kv_cache_memory_gb=256 * MIB / GIB, max_seq_len=4096)
    with pytest.raises(ValueError, match=r"holds only 2048 tokens.*max_seq_len 4096.*--kv-cache-memory-gb"):
        cfg.kv_geometry(_layout().bytes_per_token)


def test_token_sized_configs_keep_their_geometry():
    assert EngineConfig(kv_capacity_tokens=DEFAULT_KV_TOKENS).geometry() == (1024, 16, None)
    assert EngineConfig(num_slots=3, max_seq_len=32).kv_geometry(999).layout == "slots"
    assert EngineConfig(kv_capacity_tokens=64, block_size=16).kv_geometry(999).num_blocks == 4
    # max_seq_len 0 is the model's context: what the engine passes as model_len
    assert EngineConfig(num_slots=3).kv_geometry(999, model_len=512) == KVGeometry("slots", 3, 512, 512)
    assert EngineConfig(kv_capacity_tokens=64).kv_geometry(999, model_len=512).max_seq_tokens == 512
    with pytest.raises(ValueError, match="--num-slots.*needs --max-seq-len"):
        EngineConfig(num_slots=3).kv_geometry(999)
    with pytest.raises(ValueError, match="kv_geometry"):
        EngineConfig(kv_cache_memory_gb=1).geometry()
    with pytest.raises(ValueError, match="kv_geometry"):
        EngineConfig().geometry()   # nothing set: on cpu the default memory budget sizes the pool


def test_the_first_sizing_set_wins_as_the_flags_do():
    both = dict(kv_cache_memory_gb=1, num_slots=2, max_seq_len=32)
    assert EngineConfig(**both).sizing == "num_slots" and EngineConfig(**both).kv_geometry(1).layout == "slots"
    assert EngineConfig(kv_capacity_tokens=64, **both).sizing == "kv_capacity_tokens"
    assert EngineConfig(kv_cache_memory_gb=1).sizing == "kv_cache_memory_gb"
    assert EngineConfig().sizing == "cpu_default" and EngineConfig(device="cpu:0-1").sizing == "cpu_default"
    assert EngineConfig(device="cuda:1").sizing == "gpu_memory_utilization"


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_cache_memory_gb=-1.0), "--kv-cache-memory-gb must be >= 0, got -1.0"),
    (dict(gpu_memory_utilization=1.5, device="cuda"), r"--gpu-memory-utilization must be in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization=0.0, device="cuda"), r"--gpu-memory-utilization must be in \(0, 1\], got 0.0"),
    (dict(num_slots=2, max_seq_len=32, kv_layout="paged"), "contradicts --num-slots"),
    (dict(kv_layout="ring"), "kv_layout must be one of auto, paged, slots, got 'ring'"),
    (dict(max_running=0), "--max-running must be >= 1, got 0"),
    (dict(max_running=2.0), "--max-running must be an integer, got 2.0"),
    (dict(max_seq_len=1), r"--max-seq-len must be 0 \(the model's context\) or >= 2"),
    (dict(kv_capacity_tokens=8), "--kv-capacity-tokens .8. must hold at least one block of --block-size 16"),
    (dict(device="gpu"), "--device must be 'cpu', 'cpu:0-3'"),
])
def test_bad_sizing_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_gpu_budget_is_a_fraction_of_total_less_the_weights():
    assert gpu_kv_budget(total_bytes=80 * GIB, free_bytes=64 * GIB, used_bytes=16 * GIB, utilization=0.9) == 56 * GIB
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        gpu_kv_budget(80 * GIB, 64 * GIB, 16 * GIB, 0.2)
    # other stages on the GPU hold 54 GiB: the budget shrinks to what is free instead of failing
    assert gpu_kv_budget(80 * GIB, 10 * GIB, 16 * GIB, 0.9) == 10 * GIB
    with pytest.raises(ValueError, match="no device memory is free"):
        gpu_kv_budget(80 * GIB, 0, 16 * GIB, 0.9)
    cfg = EngineConfig(gpu_memory_utilization=0.9, max_seq_len=4096, device="cuda")
    assert cfg.kv_geometry(_layout().bytes_per_token, memory_bytes=56 * GIB, paged_kernel=True).num_blocks == \
        64 * 4096 // 16   # capped at max_running requests


def test_default_cpu_budget_is_bounded():
    assert 0 < default_cpu_kv_bytes() <= 2 * GIB


def test_decode_service_flags_are_the_engine_config():
    cfg = parse(["--model", "m", "--kv-cache-memory-gb", "1.5", "--max-running", "8", "--device", "cpu:0"])
    assert isinstance(cfg, EngineConfig) and cfg.torch_device == "cpu"
    assert cfg.kv_memory_bytes() == int(1.5 * GIB) and cfg.max_running == 8
    # 1.5 GiB of 64 KiB tokens: 24576 tokens, 6 slots of the model's 4096 (at most 8 = --max-running)
    assert cfg.kv_geometry(1 << 16, model_len=4096) == KVGeometry("slots", 6, 4096, 4096)
    assert parse(["--model", "m"]).kv_memory_bytes() == default_cpu_kv_bytes()
    gpu = parse(["--model", "m", "--device", "cuda:0", "--gpu-memory-utilization", "0.8"])
    assert gpu.sizing == "gpu_memory_utilization" and gpu.gpu_memory_utilization == 0.8
    assert gpu.kv_memory_bytes(memory_bytes=GIB) == GIB
    slots = parse(["--model", "m", "--num-slots", "4", "--max-seq-len", "256"])
    assert slots.kv_geometry(1, model_len=4096) == KVGeometry("slots", 4, 256, 256)
    paged = parse(["--model", "m", "--kv-capacity-tokens", "1024"])
    assert paged.kv_geometry(1, model_len=2048) == KVGeometry("paged", 64, 16, 2048)
    every = parse(["--model", "m", "--kv-capacity-tokens", "1024", "--num-slots", "4", "--kv-cache-memory-gb", "1"])
    assert every.sizing == "kv_capacity_tokens"   # a deployment may set several: the first wins
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--max-seq-len", "1"])


def test_flashinfer_is_chosen_only_when_importable_on_cuda_half():
    assert paged_kernel_available("cuda", torch.bfloat16, flashinfer_importable=True)
    assert not paged_kernel_available("cuda", torch.bfloat16, flashinfer_importable=False)
    assert not paged_kernel_available("cpu", torch.bfloat16, flashinfer_importable=True)
    assert not paged_kernel_available("cuda", torch.float32, flashinfer_importable=True)
    assert select_attention("paged", paged_kernel=True) == "flashinfer"
    assert select_attention("paged", paged_kernel=False) == "paged-gather"
    assert select_attention("slots", paged_kernel=True) == "slots"
    with pytest.raises(ValueError, match="layout"):
        select_attention("ring", paged_kernel=False)


def test_flashinfer_page_table_covers_each_row_length():
    indptr, indices, last = paged_kv_indices([(7, 3, 9), (4,), (5, 6)], positions=[32, 0, 15], block_size=16)
    assert indptr == [0, 3, 4, 5] and indices == [7, 3, 9, 4, 5] and last == [1, 1, 16]
