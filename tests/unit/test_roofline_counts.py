"""The roofline's FLOP and byte counts of each family's layers against hand counts on one small
config (bf16: 2 bytes). Rules: a linear over t tokens din -> dout is 2*t*din*dout FLOPs and
(din*dout + t*(din+dout)) elements; attention is 4*pairs*heads*head_dim FLOPs and
4*tokens*heads*head_dim elements (causal pairs s(s+1)/2); decode attention reads 2*ctx*kv*hd."""
import pytest

from easerve.roofline.cost import Cost
from easerve.roofline.models import ARCHS, LanguageModel
from easerve.roofline.spec import DeviceSpec, Efficiency

TEXT = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "num_hidden_layers": 2, "vocab_size": 10}


def test_lm_prefill_hand_count():
    # one prompt of 3 tokens, per layer: qkv 8->16 (2 q heads + 2x1 kv heads of 4): 768 FLOPs, (128+3*24)*2 = 400 B;
    # o 8->8: 384, (64+48)*2 = 224; gate+up 8->32: 1536, (256+120)*2 = 752; down 16->8: 768, (128+72)*2 = 400;
    # causal attention 6 pairs: 4*6*8 = 192 FLOPs, 4*3*8*2 = 192 B  => 3648 FLOPs, 1968 B per layer
    # KV written: 3 tokens x 2 layers x (K+V) x 1 head x 4 x 2 B = 96 B; logits of the last token 8->10: 160, (80+18)*2 = 196
    c = LanguageModel.from_config(TEXT).prefill_cost([3], 2)
    assert (c.flops, c.bytes, c.layers) == (2 * 3648 + 160, 2 * 1968 + 96 + 196, 2)


def test_lm_decode_hand_count():
    # two running requests (contexts 5 and 7), per layer over 2 tokens: qkv 512, (128+48)*2 = 352; o 256, (64+32)*2 = 192;
    # gate+up 1024, (256+80)*2 = 672; down 512, (128+48)*2 = 352; attention 4*12*8 = 384 FLOPs, KV read 12*2*1*4*2 = 192 B
    # => 2688 FLOPs, 1760 B per layer; logits of 2 tokens: 320, (80+36)*2 = 232
    c = LanguageModel.from_config(TEXT).decode_cost([5, 7], 2)
    assert (c.flops, c.bytes) == (2 * 2688 + 320, 2 * 1760 + 232)
    assert LanguageModel.from_config(TEXT).kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2


def test_qwen_vision_hand_count():
    cfg = {"model_type": "qwen2_5_vl", "text_config": TEXT, "vision_config": {
        "hidden_size": 8, "num_heads": 2, "intermediate_size": 16, "depth": 2, "fullatt_block_indexes": [1],
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "out_hidden_size": 8}}
    arch = ARCHS["qwen2_5_vl"](cfg, {"image_processor": {"size": {"shortest_edge": 3136, "longest_edge": 1 << 20}}})
    assert arch.rows("image", "112x112") == 16                  # 8x8 patches, merged 2x2
    # patch embed over 64 patches, 1176 -> 8: 1,204,224 FLOPs, (9408 + 64*1184)*2 = 170,368 B
    # per layer linears (64 tokens): qkv 24576 / 4480 B, o 8192 / 2176, gate+up 32768 / 5632, down 16384 / 3328 = 81920 / 15616
    # full-attention layer: one seq of 64: 131072 FLOPs; window layer: 4 windows of 16 patches: 32768; 4096 B each
    # merger over 16 rows: 32->32: 32768 / 4096 B, 32->8: 8192 / 1792 B
    c = arch.encode_cost("image", ["112x112"], 2)
    assert c.flops == 1_204_224 + 2 * 81920 + 131072 + 32768 + 32768 + 8192
    assert c.bytes == 170_368 + 2 * 15616 + 2 * 4096 + 4096 + 1792
    assert c.layers == 4                                         # 2 blocks + embed + merger


def test_llava_next_clip_hand_count():
    cfg = {"model_type": "llava_next", "text_config": TEXT, "image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]],
           "vision_config": {"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
                             "num_hidden_layers": 1, "patch_size": 14, "image_size": 28}}
    arch = ARCHS["llava_next"](cfg, None)
    # 28x28 -> pinpoint 28x56 (least waste): 2 tiles + base = 3 tiles of 2x2 patches (+CLS: 5 tokens)
    # rows: grid 2x4 patches, unpadded to 2x2 (+2 newline rows) + base 4 = 10
    assert arch.rows("image", "28x28") == 10
    # embed 12 patches 588 -> 8: 112,896 / (4704 + 12*596)*2 = 23,712 B
    # layer over 15 tokens: qkv 5760 / 1344, o 1920 / 608, fc1 3840 / 976, fc2 3840 / 976, attention 3x5^2: 2400 / 960
    # projector over 12 patches: 8->8 twice: 1536 / 512 B each
    c = arch.encode_cost("image", ["28x28"], 2)
    assert (c.flops, c.bytes) == (112_896 + 17_760 + 3_072, 23_712 + 4_864 + 1_024)


def test_ultravox_whisper_hand_count():
    cfg = {"model_type": "ultravox", "text_config": TEXT, "stack_factor": 2, "hidden_size": 8,
           "audio_config": {"d_model": 8, "encoder_attention_heads": 2, "encoder_ffn_dim": 16, "encoder_layers": 1,
                            "num_mel_bins": 4}}
    arch = ARCHS["ultravox"](cfg, None)
    assert arch.rows("audio", "0.1s") == 3                       # 10 mel frames / (2*2), rounded up
    # conv1 over 10 frames, 4 mels x 3 -> 8: 1920 / 592 B; conv2 over 5 positions 24 -> 8: 1920 / 704 B
    # layer over 5 positions: qkv 1920 / 704, o 640 / 288, fc1 1280 / 496, fc2 1280 / 496, attention 800 / 320
    # projector over 3 stacked rows: 16->8: 768 / 400 B; swiglu half 4->8: 192 / 136 B
    c = arch.encode_cost("audio", ["0.1s"], 2)
    assert (c.flops, c.bytes) == (1920 + 1920 + 5920 + 768 + 192, 592 + 704 + 2304 + 400 + 136)


def _spec(**eff) -> DeviceSpec:
    return DeviceSpec("t", tflops=1.0, mem_gb_per_s=1.0, mem_gib=1.0, sm_count=1, interconnect_gb_per_s=0.5,
                      source="test", efficiency=Efficiency(1.0, 1.0, 0.0, 0.0, 1e-3))


def test_seconds_roofline_and_tensor_parallel():
    s = _spec()
    compute_bound = Cost(flops=2e12, bytes=1e9, layers=3, allreduce_bytes=1e9, allreduces=4)
    assert s.seconds(compute_bound) == pytest.approx(2.0)          # max(2 s compute, 1 s memory)
    assert s.seconds(compute_bound, share=0.5) == pytest.approx(4.0)
    # tp=2: half the FLOPs per device (1 s) + 4 all-reduces x 1 ms + ring 2(2-1)/2 x 1 GB at 0.5 GB/s (2 s)
    assert s.seconds(compute_bound, tp=2) == pytest.approx(1.0 + 0.004 + 2.0)
    memory_bound = Cost(flops=1e9, bytes=3e9)
    assert s.seconds(memory_bound) == pytest.approx(3.0)
    assert s.seconds(memory_bound, share=0.5) == pytest.approx(3.0)  # bandwidth saturates at half the SMs
