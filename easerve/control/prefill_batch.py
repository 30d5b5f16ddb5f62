"""TEMPORARY stand-in (the real planner is being written on another branch)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillBatchConfig:
    max_batched_tokens: int = 2048
    max_batch_size: int = 16
