#!/usr/bin/env python3
"""Build the wheel bundle the GPU machine needs: the packages its image (Python 3.12, torch
2.11 cu130, transformers 5.17, cuda-bindings; no package registry) lacks, as x86-64 CPython
3.12 wheels, without their dependencies (each one a dependency needs is listed itself). The
bundle travels with the working tree (the device tool carries 64 MiB per call in all), so it
must stay under 40 MiB: the build fails naming the largest wheels when it does not.

    python scripts/build_gpu_bundle.py                 # -> dist/gpu-bundle/*.whl
    bash scripts/gpu-check.sh                          # there: install it, run gpu_check.py

What is left out on purpose: what the image has (torch and transformers' own
dependencies: numpy, tokenizers, safetensors, huggingface-hub, pyyaml, tqdm, pillow, ...),
and what the GPU check never imports (av: 35 MB; optuna, matplotlib: hasctl tune / report).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 40 << 20
PYTHON, ABI = "3.12", "cp312"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
# the serving stack's imports that the image lacks, with their own dependencies
PACKAGES = (
    # the image's transformers 5.17 predates the config and cache API the adapters use (5.24:
    # SubConfigSpec, `cache=`, bos/eos on the composite configs); 5.24 is pure Python and its
    # needs (huggingface-hub >= 1.31, tokenizers 0.23) are in the image
    "transformers==5.24.0",
    "grpcio", "grpcio-health-checking", "protobuf", "uvloop", "prometheus-client", "soxr",
    "aiohttp", "aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict", "propcache", "yarl", "idna",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
)


def download(dest: Path, packages=PACKAGES) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--dest", str(dest),
            "--python-version", PYTHON, "--implementation", "cp", "--abi", ABI, "--abi", "abi3", "--abi", "none",
            *[a for p in PLATFORMS for a in ("--platform", p)], *packages]
    subprocess.run(argv, check=True)


def check_size(dest: Path, limit: int = LIMIT_BYTES) -> int:
    """Total bytes of the bundle's wheels; ValueError naming the largest when over `limit`."""
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    total = sum(p.stat().st_size for p in wheels)
    if total > limit:
        top = ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in wheels[:3])
        raise ValueError(f"the GPU bundle is {total / 2**20:.1f} MiB, over {limit / 2**20:.0f} MiB; "
                         f"largest: {top}. Leave out what the GPU check does not import")
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=str(ROOT / "dist" / "gpu-bundle"))
    ap.add_argument("--check-only", action="store_true", help="only check the size of an existing bundle")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    if not args.check_only:
        download(dest)
    try:
        total = check_size(dest)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB (limit {LIMIT_BYTES >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
