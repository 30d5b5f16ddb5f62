"""The stage configs are the one source of their settings: bounds declared in the field types
(errors name the flag), choices taken from the modules that own them, the encode batcher's and
partitioner's configs built from the encode flags."""
from __future__ import annotations

import pytest

from easerve import transport
from easerve.fields import FieldError
from easerve.partition import backends
from easerve.policy import batcher, partitioner
from easerve.policy.batcher import BatcherConfig
from easerve.policy.partitioner import PartitionerConfig
from easerve.stages.common.argv import from_argv, parser
from easerve.stages.common.configs import STAGE_CONFIGS, EncodeConfig, GatewayConfig, PrefillConfig

ENCODE = ["--model", "m", "--prefill", "h:1"]


def _choices(stage: str, flag: str) -> tuple:
    action = next(a for a in parser(STAGE_CONFIGS[stage], stage)._actions if flag in a.option_strings)
    return tuple(action.choices)


def test_choices_are_the_owners():
    assert _choices("encode", "--batch-mode") == batcher.MODES
    assert _choices("encode", "--sm-backend") == backends.PREFERENCES
    assert _choices("encode", "--partition-policy") == partitioner.POLICIES
    assert _choices("prefill", "--kv-transport") == _choices("encode", "--kv-transport") == transport.KINDS


def test_encode_builds_its_batcher_and_partitioner_configs():
    cfg = from_argv(EncodeConfig, "encode", [*ENCODE, "--max-batch", "4", "--batch-mode", "fixed",
                                             "--safety-cap-s", "0.03", "--gap-coef", "3", "--max-gap-s", "0.05",
                                             "--partition-policy", "static", "--partition-tolerance", "0.2"])
    # the gap ceiling is at most the safety cap
    assert cfg.batcher == BatcherConfig(max_batch=4, mode="fixed", safety_cap_s=0.03, gap_coef=3.0, max_gap_s=0.03)
    assert cfg.partitioner == PartitionerConfig(policy="static", tolerance=0.2)
    default = from_argv(EncodeConfig, "encode", ENCODE)
    assert (default.max_batch, default.batch_mode, default.safety_cap_s, default.gap_coef) == \
        (BatcherConfig.max_batch, BatcherConfig.mode, BatcherConfig.safety_cap_s, BatcherConfig.gap_coef)


@pytest.mark.parametrize("cls,kwargs,message", [
    # the batcher's and partitioner's own bounds, named by the encode flag that sets them
    (EncodeConfig, {"max_batch": 0}, "--max-batch must be >= 1, got 0"),
    (EncodeConfig, {"max_batch": 2.5}, "--max-batch must be an integer, got 2.5"),
    (EncodeConfig, {"safety_cap_s": 0.0}, "--safety-cap-s must be > 0, got 0.0"),
    (EncodeConfig, {"gap_coef": float("inf")}, "--gap-coef must be a finite number, got inf"),
    (EncodeConfig, {"max_gap_s": -1.0}, "--max-gap-s must be > 0, got -1.0"),
    (EncodeConfig, {"partition_tolerance": -0.1}, "--partition-tolerance must be >= 0, got -0.1"),
    (EncodeConfig, {"batch_mode": "greedy"}, "--batch-mode must be one of adaptive, fixed, "
                                             "request_at_a_time, continuous, got 'greedy'"),
    (EncodeConfig, {"remote_fraction": 1.5}, r"--remote-fraction must be in [0, 1] (s), got 1.5"),
    (EncodeConfig, {"encoder_cache_gb": -1.0}, "--encoder-cache-gb must be >= 0 (0 turns the cache off), got -1.0"),
    (EncodeConfig, {"prefill": ("nohost",)}, "--prefill: address 'nohost' must be host:port"),
    (EncodeConfig, {"threads": -1}, "--threads must be >= 0 (0 = automatic), got -1"),
    (PrefillConfig, {"decode": ("h:2",), "max_inflight": 0}, "--max-inflight must be >= 1, got 0"),
    (PrefillConfig, {"decode": ("h:2",), "kv_transport": "rdma"}, "--kv-transport must be one of auto, inline, "
                                                                  "shm, grpc, cuda_ipc, nccl, got 'rdma'"),
    (GatewayConfig, {"prefill": ("h:1",), "decode": ("h:2",), "request_timeout_s": 0.0},
     "--request-timeout-s must be > 0, got 0.0"),
    (GatewayConfig, {"prefill": ("h:1",), "decode": ("h:2",), "listen": "50051"},
     "--listen must be host:port, got '50051'"),
])
def test_a_bad_value_names_its_flag(cls, kwargs, message):
    base = {"model": "m", **({"prefill": ("h:1",)} if cls is EncodeConfig else {})}
    with pytest.raises(FieldError) as e:
        cls(**{**base, **kwargs})
    assert str(e.value) == message


def test_a_bad_flag_exits_with_the_message(capsys):
    with pytest.raises(SystemExit):
        from_argv(EncodeConfig, "encode", [*ENCODE, "--max-batch", "0"])
    assert capsys.readouterr().err.endswith("error: --max-batch must be >= 1, got 0\n")


def test_policy_configs_name_their_own_fields():
    with pytest.raises(FieldError, match="^max_batch must be >= 1, got 0$"):
        BatcherConfig(max_batch=0)
    with pytest.raises(FieldError, match=r"^static_share must be in \(0, 1\), got 1.0$"):
        PartitionerConfig(static_share=1.0)


def test_prefix_cache_is_on_unless_turned_off():
    on = from_argv(PrefillConfig, "prefill", ["--model", "m", "--decode", "127.0.0.1:1"])
    assert on.prefix_cache is not None and on.prefix_cache.block_tokens == 16
    assert on.prefix_cache.budget_bytes == 2**30
    off = from_argv(PrefillConfig, "prefill", ["--model", "m", "--decode", "127.0.0.1:1", "--no-prefix-cache"])
    assert off.prefix_cache is None
    enc = from_argv(EncodeConfig, "encode", [*ENCODE, "--prefix-block-tokens", "32", "--prefix-cache-gb", "0.5"])
    assert (enc.prefix_cache.block_tokens, enc.prefix_cache.budget_bytes) == (32, 2**29)
