"""Stand-ins for `cuda.bindings.driver` and the parts of torch.cuda that the green-context
backend uses, for machines without a GPU: `gpu_check.py --dry-run` and the unit tests inject
them (`GreenContextBackend(driver=..., torch=...)`). They follow the real calls' shapes:
every driver call returns (CUresult, *values), CUresult 0 meaning success; SM splits honour
the alignment; what was created, made current and destroyed is logged in order (`log`)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace as NS
from typing import Any

SUCCESS, ERROR = NS(value=0, name="CUDA_SUCCESS"), NS(value=1, name="CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION")


class SmResource:
    def __init__(self, n: int, align: int) -> None:
        self.sm = NS(smCount=n, smCoscheduledAlignment=align, minSmPartitionSize=align)


class FakeDriver:
    """A device of `total_sms` SMs split in multiples of `align`; a green context over fewer
    than `refuse_below` SMs is refused (as a driver refuses a remainder it cannot use).
    `version`: what cuDriverGetVersion reports. `missing`: names this module lacks."""

    CUdevResourceType = NS(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = NS(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = NS(CU_STREAM_NON_BLOCKING=1)

    def __init__(self, total_sms: int = 132, align: int = 8, refuse_below: int = 0, version: int = 12080,
                 missing: tuple[str, ...] = ()) -> None:
        self.total_sms, self.align, self.refuse_below, self.version = total_sms, align, refuse_below, version
        self.log: list[tuple] = []
        self._next = 1000
        self._missing = frozenset(missing)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("cu") and name in object.__getattribute__(self, "_missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def cuDriverGetVersion(self):
        return SUCCESS, self.version

    def cuDeviceGet(self, index: int):
        return SUCCESS, ("dev", index)

    def cuDeviceGetDevResource(self, dev, kind):
        return SUCCESS, SmResource(self.total_sms, self.align)

    def cuDevSmResourceSplitByCount(self, n_groups: int, res: SmResource, flags: int, count: int):
        if count % self.align or count > res.sm.smCount:
            return ERROR, None, 0, None
        self.log.append(("split", res.sm.smCount, count))
        return SUCCESS, [SmResource(count, self.align)], 1, SmResource(res.sm.smCount - count, self.align)

    def cuDevResourceGenerateDesc(self, resources, n: int):
        return SUCCESS, resources[0]

    def cuGreenCtxCreate(self, desc: SmResource, dev, flags):
        if desc.sm.smCount < self.refuse_below:
            return (ERROR, None)
        self._next += 1
        return SUCCESS, ("gctx", self._next, desc.sm.smCount)

    def cuGreenCtxStreamCreate(self, gctx, flags, priority):
        return SUCCESS, 10_000 + gctx[1]

    def cuCtxFromGreenCtx(self, gctx):
        return SUCCESS, ("ctx", gctx[1])

    def cuCtxPushCurrent(self, ctx):
        self.log.append(("push", ctx))
        return (SUCCESS,)

    def cuCtxPopCurrent(self):
        self.log.append(("pop",))
        return SUCCESS, None

    def cuStreamDestroy(self, raw):
        self.log.append(("destroy", raw))
        return (SUCCESS,)

    def cuGreenCtxDestroy(self, gctx):
        self.log.append(("destroy", gctx))
        return (SUCCESS,)


class FakeStream:
    """A torch.cuda stream stand-in; `log` is shared with the driver so the order of waits,
    context pushes and syncs can be checked."""

    def __init__(self, key: tuple, log: list) -> None:
        self.key, self.log, self.device = key, log, "cuda:0"

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait", self.key, other.key))

    def synchronize(self) -> None:
        self.log.append(("sync", self.key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"FakeStream{self.key}"


def fake_torch(driver: FakeDriver, device_name: str = "fake GPU") -> Any:
    """The torch.cuda surface GreenContextBackend and its stream scopes touch."""
    log = driver.log
    outer = FakeStream(("outer",), log)
    current = [outer]

    @contextlib.contextmanager
    def stream(s):
        prev, current[0] = current[0], s
        try:
            yield s
        finally:
            current[0] = prev

    cuda = NS(is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda i=0: device_name,
              get_device_properties=lambda i: NS(major=9, multi_processor_count=driver.total_sms),
              device=lambda i: contextlib.nullcontext(),
              Stream=lambda dev, priority=0: FakeStream(("plain", dev, priority), log),
              ExternalStream=lambda ptr, device: FakeStream(("green", ptr), log),
              synchronize=lambda i=None: None, stream=stream, current_stream=lambda device=None: current[0])
    return NS(cuda=cuda, empty=lambda *a, **k: None, __version__="fake")
