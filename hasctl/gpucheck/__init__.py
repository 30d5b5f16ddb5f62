"""The one prepared GPU run (scripts/gpu_check.py): its sections, the runner that gives each
a subprocess and a timeout, and the CPU stand-ins its `--dry-run` uses."""
