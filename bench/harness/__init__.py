"""What every bench script shares: the tiny checkpoint it serves (checkpoint), the stacks it
starts (stack), the open-loop load it sends (load), how a run is scored (scoring) and where its
result is kept (results)."""
