"""The encode control plane: pure, clock-injected policies (batcher, router, partitioner)
and the mechanisms that realize compute partitions (`sm_backends`, torch imported lazily)."""
from easerve.control.batcher import AdaptiveBatcher, BatcherConfig, Dispatch
from easerve.control.clock import Clock, ManualClock, MonotonicClock
from easerve.control.partitioner import (
    DEFAULT_SHARES, TIMESLICE, Allocation, PartitionerConfig, ProfileTable, SMPartitioner, profile)
from easerve.control.router import DeficitRouter, RandomRouter, Route, Router, max_prefix_error
from easerve.control.green_contexts import GreenContextBackend
from easerve.control.sm_backends import (
    CpuAffinityBackend, MPSBackend, PartitionController, SMBackend, StaticSplitBackend, TimeSliceBackend,
    select_backend)

__all__ = [
    "AdaptiveBatcher", "BatcherConfig", "Dispatch",
    "Clock", "ManualClock", "MonotonicClock",
    "DEFAULT_SHARES", "TIMESLICE", "Allocation", "PartitionerConfig", "ProfileTable",
    "SMPartitioner", "profile",
    "DeficitRouter", "RandomRouter", "Route", "Router", "max_prefix_error",
    "CpuAffinityBackend", "GreenContextBackend", "MPSBackend", "PartitionController", "SMBackend",
    "StaticSplitBackend", "TimeSliceBackend", "select_backend",
]
