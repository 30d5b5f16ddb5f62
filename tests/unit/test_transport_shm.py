import asyncio
import gc
import os

import pytest
import torch

from easerve.wire import codec
from easerve.errors import CodecError, NotFound
from easerve.transport.base import ShmHandle, handle_from_proto, handle_to_proto
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import kv_pb2

PREFIX = "easerve-t"


def kv(tokens=5, layers=3, rid="r1") -> KVPayload:
    g = torch.Generator().manual_seed(tokens)
    mk = lambda: torch.randn(2, tokens, 8, generator=g).to(torch.bfloat16)  # noqa: E731
    return KVPayload(rid, [mk() for _ in range(layers)], [mk() for _ in range(layers)],
                     prompt_len=tokens, rope_delta=0, first_token=3, sampling=SamplingParams())


def same(a: KVPayload, b: KVPayload) -> bool:
    return a.request_id == b.request_id and all(
        torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}


async def send(t, p=None):
    p = p or kv()
    h = await t.send(p.request_id, *codec.kv_to_parts(p))
    return handle_from_proto(kv_pb2.KVTransfer.FromString(handle_to_proto(h).SerializeToString())), p


def run(coro):
    before = names()
    asyncio.run(coro)
    gc.collect()
    assert names() == before, "shared memory leaked"


@pytest.mark.parametrize("copy_out", [False, True])
def test_one_off_segment_roundtrip_unlinks(copy_out):
    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=0, copy_out=copy_out))
        before = names()
        h, p = await send(t)
        assert not h.slab and names() - before == {h.name}
        assert same(codec.kv_from_parts(*await t.recv(h)), p) and names() == before
        assert t.last_gbps and t.last_gbps > 0
        t.release(h)  # idempotent once taken
        with pytest.raises(NotFound, match="gone"):
            await t.recv(h)
    run(main())


def test_one_off_release_close_and_ttl():
    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=0))
        before = names()
        h1, _ = await send(t)
        h2, _ = await send(t)
        t.release(h1)
        assert names() - before == {h2.name}
        await t.close()
        assert names() == before and t.pending == []
        short = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=0, ttl_s=0.01))
        await send(short)
        await asyncio.sleep(0.02)
        await send(short)  # sweeps the expired one
        assert len(names() - before) == 1
        await short.close()
    run(main())


def test_failed_write_frees_everything():
    async def main():
        for slab in (0, 1 << 20):
            t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=slab))
            header, ts = codec.kv_to_parts(kv())
            with pytest.raises(CodecError):
                await t.send("x", header, ts[:-1])
            assert t.pending == [] and (t._slab is None or t._slab.used_bytes == 0)
            await t.close()
    run(main())


def test_slab_views_recycle_region_when_dropped():
    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=1 << 20))
        h, p = await send(t)
        assert h.slab and h.generation == 1
        got = codec.kv_from_parts(*await t.recv(h))
        assert same(got, p) and t._slab.used_bytes > 0
        with pytest.raises(NotFound, match="already taken"):
            await t.recv(h)
        del got
        gc.collect()
        t._slab.reclaim()
        assert t._slab.used_bytes == 0
        h2, _ = await send(t)
        assert h2.offset == h.offset and h2.generation == 2  # the same region, reused
        await t.close()
    run(main())


def test_slab_copy_out_frees_at_once_and_release_and_ttl():
    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=1 << 20, copy_out=True, ttl_s=0.05))
        h, p = await send(t)
        assert same(codec.kv_from_parts(*await t.recv(h)), p)
        t._slab.reclaim()
        assert t._slab.used_bytes == 0
        h, _ = await send(t)
        t.release(h)  # never taken: back to the slab
        assert t._slab.used_bytes == 0
        with pytest.raises(NotFound, match="released or reused"):
            await t.recv(h)
        await send(t)
        await asyncio.sleep(0.06)
        t._slab.reclaim()  # expired without a taker
        assert t._slab.used_bytes == 0
        await t.close()
    run(main())


def test_slab_full_falls_back_to_one_off_segments():
    async def main():
        p = kv(tokens=64, layers=4)  # ~16 KB frame
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=40 << 10))
        hs = [(await send(t, p))[0] for _ in range(3)]
        assert [h.slab for h in hs] == [True, True, False]
        for h in hs:
            assert same(codec.kv_from_parts(*await t.recv(h)), p)
        await t.close()
    run(main())


def test_slab_free_list_merges():
    from easerve.transport.shm_slab import SlabWriter

    w = SlabWriter(f"{PREFIX}-merge", 64 * 10)
    try:
        regions = [w.alloc(64, ttl_s=60) for _ in range(5)]  # 128 bytes each
        assert w.alloc(64, ttl_s=60) is None
        for off, gen in (regions[1], regions[3], regions[2]):
            w.free(off, gen)
        assert w.alloc(64 * 4, ttl_s=60) is not None  # the three freed regions merged
    finally:
        w.close()
    assert f"{PREFIX}-merge" not in names()


def test_handle_to_a_closed_slab_is_not_found():
    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=1 << 20))
        h, _ = await send(t)
        await t.close()
        with pytest.raises(NotFound, match="gone"):
            await ShmTransport().recv(h)
        with pytest.raises(NotFound):
            await ShmTransport().recv(ShmHandle("x", h.name, 10, 5, slab=True, generation=1))
    run(main())


def test_small_dev_shm_disables_slab_then_refuses(monkeypatch):
    from easerve.errors import Overloaded
    from easerve.transport import shm

    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=1 << 20))
        monkeypatch.setattr(shm.segments, "free_bytes", lambda: 1 << 20)  # < 2 x slab: no slab
        h, p = await send(t)
        assert not h.slab and same(codec.kv_from_parts(*await t.recv(h)), p)
        monkeypatch.setattr(shm.segments, "free_bytes", lambda: 100)
        with pytest.raises(Overloaded, match="shm_size"):
            await send(t)
        await t.close()
    run(main())


SENDER = r"""
import asyncio, sys
from easerve.transport.base import handle_to_proto
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.wire import codec
from tests.unit.test_transport_shm import PREFIX, kv

async def main():
    t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=1 << 20))
    h = await t.send("r1", *codec.kv_to_parts(kv()))
    print(handle_to_proto(h).SerializeToString().hex(), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_dead_senders_slab_is_unlinked_and_unmapped_by_its_receiver():
    """A sender killed with its whole process group (its resource tracker too, as the launcher
    kills a dead stage's leftovers) leaves its slab in /dev/shm with nobody holding the owner's
    lock; the receiver that maps it unlinks it and lets go of it within a few TIDY_S, without
    any new slab arriving (the chaos soak saw a dead encode's slab held by a prefill to the end)."""
    _dead_sender(in_cycle=False)


def test_a_dead_senders_slab_viewed_only_from_a_reference_cycle_is_let_go_without_outside_help():
    """The same with the received tensors left in a reference cycle (as a failed call's traceback
    holds its frames) and the garbage collector's automatic runs off (an idle process allocates
    nothing to start one): the receiver's own tidying collects it and lets go of the slab (the
    10-minute chaos soak at f625ed0 ended with a prefill holding a dead slab's 2 fds)."""
    _dead_sender(in_cycle=True)


def _dead_sender(in_cycle: bool) -> None:
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from easerve.transport import shm

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    child = subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, env=env, cwd=root,
                             start_new_session=True)

    def fds_on(name: str) -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").endswith(name)
            except OSError:
                pass
        return n

    async def main():
        line = await asyncio.to_thread(child.stdout.readline)
        h = handle_from_proto(kv_pb2.KVTransfer.FromString(bytes.fromhex(line.decode().strip())))
        t = ShmTransport(ShmConfig(prefix=PREFIX))
        got = codec.kv_from_parts(*await t.recv(h))
        assert h.slab and same(got, kv()) and t._reader.mapped == 1 and fds_on(h.name) >= 1
        if in_cycle:
            gc.disable()
            cycle = {"got": got}
            cycle["self"] = cycle
            del got, cycle
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert os.path.exists(f"/dev/shm/{h.name}")  # nobody else unlinks it
        await asyncio.sleep(3 * shm.TIDY_S + 0.5)
        assert t._reader.mapped == 0 and not os.path.exists(f"/dev/shm/{h.name}")
        if not in_cycle:
            del got
            gc.collect()
        assert fds_on(h.name) == 0
        assert t._reader.dead_held == 0
        await t.close()

    try:
        run(main())
    finally:
        gc.enable()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
