"""Pure, clock-injected policies with no torch and no I/O: batcher, router, SM partitioner, placement, prefill batch planner. The services and the simulator run these same classes."""
