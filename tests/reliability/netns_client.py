"""The client side of tests/reliability/test_netns.py, run inside a network namespace
(`ip netns exec NS python -m tests.reliability.netns_client ...`); one JSON line per result.

    wait SECONDS ADDR...             every ADDR answers grpc.health.v1 SERVING
    generate ADDR [--image]          one request; {"text", "tokens"} or {"error", "message"}
    stream ADDR TIMEOUT MAX_TOKENS   a line {"tokens": n} per chunk, then {"error", "message", "elapsed_s"}
"""
from __future__ import annotations

import json
import sys
import time


def _out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def wait(seconds: float, addrs: list[str]) -> int:
    from easerve.healthcheck import check
    end, pending = time.monotonic() + seconds, list(addrs)
    while pending and time.monotonic() < end:
        pending = [a for a in pending if check(a, timeout=1.0) != "SERVING"]
        if pending:
            time.sleep(0.5)
    _out(pending=pending)
    return 0 if not pending else 1


def _png() -> bytes:
    import io

    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def generate(addr: str, image: bool) -> int:
    from easerve import Client
    from easerve.errors import EAServeError
    try:
        with Client(addr, timeout=60) as c:
            out = c.generate("describe", images=[_png()] if image else [], max_tokens=6, ignore_eos=True)
    except EAServeError as e:
        _out(error=e.code, message=str(e))
        return 1
    _out(text=out.text, tokens=out.usage.completion_tokens)
    return 0


def stream(addr: str, timeout: float, max_tokens: int) -> int:
    from easerve import Client
    from easerve.errors import EAServeError
    t0, n = time.monotonic(), 0
    try:
        with Client(addr) as c:
            for chunk in c.generate("Tell a long story", max_tokens=max_tokens, ignore_eos=True, stream=True,
                                    timeout=timeout):
                n += len(chunk.token_ids)
                _out(tokens=n)
    except EAServeError as e:
        _out(error=e.code, message=str(e), elapsed_s=time.monotonic() - t0, tokens=n)
        return 1
    _out(error="", message="finished", elapsed_s=time.monotonic() - t0, tokens=n)
    return 0


def main(argv: list[str]) -> int:
    cmd, *rest = argv
    if cmd == "wait":
        return wait(float(rest[0]), rest[1:])
    if cmd == "generate":
        return generate(rest[0], "--image" in rest)
    if cmd == "stream":
        return stream(rest[0], float(rest[1]), int(rest[2]))
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
