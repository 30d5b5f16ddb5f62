"""CUDA green contexts as an SMBackend: per share level, one SM split made up front into an
encode group and a prefill group, each with its own green context and stream, so switching
level is picking a pre-created stream (no driver call).

The driver is reached through `cuda.bindings.driver` (the cuda-bindings package), the same
module on every torch that runs CUDA >= 12.8, never through torch-private helpers; torch is
imported lazily. Both can be injected (`driver=`, `torch=`) so the split logic runs against
stand-ins on a machine without a GPU.

Contexts: each green stream belongs to its green context. Work entered with
`encode_context` / `prefill_context` first orders itself after the caller's stream (an event
recorded in the caller's own context, which a stream of any context may wait on), then makes
the green context current for the block, so every event recorded on the green stream inside
it (torch's allocator, a transport's ready event) is created in the stream's own context.

Prefill's group: `cuDevSmResourceSplitByCount` returns the encode group plus the remainder,
and the driver promises the split groups' properties (alignment, co-scheduling) but not the
remainder's: a kernel that needs co-scheduled SMs (e.g. a cluster launch) may not launch on
it. By default (`prefill_group="split"`) prefill gets a group of its own, a second split of
the remainder aligned like encode's; the remainder's leftover SMs stay idle (on an H200,
132 = 16 x 8 + 4: 4 SMs). `prefill_group="remainder"` runs prefill on the raw remainder (every
SM, without that promise).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, ClassVar, ContextManager, Sequence

from easerve.partition.sm_backend import BackendUnavailable, SMBackend, check_levels, stream_scope
from easerve.policy.partitioner import DEFAULT_SHARES, Allocation

MIN_DRIVER_VERSION = 12080  # cuDriverGetVersion of CUDA 12.8, the first with green contexts
# what this backend calls: a bindings module without one of these cannot run it
REQUIRED = ("cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetDevResource", "cuDevSmResourceSplitByCount",
            "cuDevResourceGenerateDesc", "cuGreenCtxCreate", "cuGreenCtxStreamCreate", "cuGreenCtxDestroy",
            "cuStreamDestroy", "cuCtxFromGreenCtx", "cuCtxPushCurrent", "cuCtxPopCurrent",
            "CUdevResourceType", "CUgreenCtxCreate_flags", "CUstream_flags")
PREFILL_GROUPS = ("split", "remainder")


def _torch() -> Any:
    import torch
    return torch


def load_driver() -> Any:
    """`cuda.bindings.driver`; ImportError saying what to install when it is missing."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError(f"cuda.bindings.driver cannot be imported ({e}): green contexts call the CUDA "
                          "driver through the cuda-bindings package (pip install cuda-bindings)") from e
    return driver


def check(result: Any, call: str = "driver call") -> Any:
    """The values of a cuda.bindings call (which returns (CUresult, *values)); RuntimeError
    naming the call and the error unless the result is CUDA_SUCCESS (0)."""
    err, *out = result if isinstance(result, tuple) else (result,)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"{call} failed: {getattr(err, 'name', err)}")
    return None if not out else out[0] if len(out) == 1 else tuple(out)


class _Supported:
    """`GreenContextBackend.SUPPORTED`, probed on first read (never at import)."""

    def __get__(self, obj: Any, owner: type) -> bool:
        return owner.probe()[0]


def probe(device_index: int = 0, *, driver: Any = None, torch: Any = None) -> tuple[bool, str]:
    """(usable, why) for green contexts on CUDA device `device_index`. Every "no" names what
    is missing; nothing is assumed present that was not found."""
    if torch is None:
        try:
            torch = _torch()
        except ImportError:
            return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if device_index >= torch.cuda.device_count():
        return False, f"no CUDA device {device_index} ({torch.cuda.device_count()} visible)"
    if driver is None:
        try:
            driver = load_driver()
        except ImportError as e:
            return False, str(e)
    missing = [n for n in REQUIRED if not hasattr(driver, n)]
    if missing:
        return False, (f"cuda.bindings.driver lacks {', '.join(missing)}: green contexts need cuda-bindings "
                       "built for CUDA >= 12.8")
    version = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
    if int(version) < MIN_DRIVER_VERSION:
        return False, (f"the CUDA driver supports CUDA {int(version) // 1000}.{int(version) % 1000 // 10}; "
                       "green contexts need >= 12.8 (update the NVIDIA driver)")
    return True, f"green contexts on {torch.cuda.get_device_name(device_index)}"


@functools.cache
def _probe_default(device_index: int) -> tuple[bool, str]:
    return probe(device_index)


ROUNDINGS = ("up", "nearest")


def sm_split(total: int, granularity: int, min_sms: int, share: float, rounding: str = "up") -> int:
    """SMs for encode at `share` of `total`, in whole granules of `granularity`, at least
    `min_sms`: rounded up (dynamic levels: encode-protective) or to the nearest granule (the
    static 50/50: 132 SMs at 8 -> 64, as near half as Hopper allows; 108 at 2 -> 54).
    A result >= total means: no split (encode keeps the device)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if total < 1 or granularity < 1 or not 0 < share <= 1:
        raise ValueError(f"need total >= 1, granularity >= 1 and share in (0, 1], got {total}, {granularity}, {share}")
    granules = share * total / granularity
    n = math.ceil(granules - 1e-9) if rounding == "up" else math.floor(granules + 0.5)
    return max(min_sms, n * granularity)


class GreenContextBackend(SMBackend):
    """Per level, an encode stream on ceil-to-granularity(share x SMs) SMs and a prefill
    stream on a disjoint group (see the module docstring for `prefill_group`), all created
    up front; `apply` only picks the index. Level 1.0 (or an encode group that would take
    every SM) uses two plain full-device streams, encode's at high priority: prefill then
    time-slices. `encode_sms` / `prefill_sms` hold what the driver actually granted (it may
    round down). Order work across the streams with CUDA events. `rounding` as in
    `sm_split`; `strict`: a prefill group the driver refuses raises instead of letting that
    level's prefill time-slice. `driver` / `torch`: stand-ins for cuda.bindings.driver and
    torch (default: the real modules)."""

    name = "green_contexts"
    dynamic = True
    SUPPORTED: ClassVar[bool] = _Supported()  # type: ignore[assignment]

    def __init__(self, levels: Sequence[float] = DEFAULT_SHARES, device_index: int = 0,
                 rounding: str = "up", strict: bool = False, prefill_group: str = "split", *,
                 driver: Any = None, torch: Any = None) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if prefill_group not in PREFILL_GROUPS:
            raise ValueError(f"prefill_group must be one of {PREFILL_GROUPS}, got {prefill_group!r}")
        self.rounding, self.strict, self.prefill_group = rounding, strict, prefill_group
        injected = driver is not None or torch is not None
        ok, why = probe(device_index, driver=driver, torch=torch) if injected else self.probe(device_index)
        if not ok:
            raise BackendUnavailable(why)
        self._torch = torch if torch is not None else _torch()
        self._drv = driver if driver is not None else load_driver()
        self.device_index = device_index
        props = self._torch.cuda.get_device_properties(device_index)
        self._handles: list[Any] = []   # (raw stream, green ctx) to destroy on close
        self.notes: list[str] = []
        lv = check_levels(levels)
        with self._torch.cuda.device(device_index):
            self._torch.empty(1, device=f"cuda:{device_index}")  # primary context current on this thread
            try:
                self._dev, self._sm = self._device_sm_resource()
                self.total_sms = self._sm.sm.smCount
                fallback = 8 if props.major >= 9 else 2  # for drivers that leave the fields 0
                self.granularity = int(getattr(self._sm.sm, "smCoscheduledAlignment", 0)) or fallback
                self.min_sms = max(int(getattr(self._sm.sm, "minSmPartitionSize", 0)), self.granularity)
                pairs = [self._make_level(s) for s in lv]
            except BackendUnavailable:
                self.close()
                raise
            except RuntimeError as e:  # what the CUDA bindings' check raises: the driver refused a call
                self.close()
                raise BackendUnavailable(f"the CUDA driver refused a green-context call ({e})") from e
            except BaseException:
                self.close()
                raise
        self._enc = tuple(p[0] for p in pairs)
        self._pre = tuple(p[1] for p in pairs)
        self.encode_sms = tuple(p[2] for p in pairs)
        self.prefill_sms = tuple(p[3] for p in pairs)
        super().__init__(lv, f"{why}: encode SMs {list(self.encode_sms)}, prefill SMs "
                             f"{list(self.prefill_sms)} of {self.total_sms}"
                             + (f" ({'; '.join(self.notes)})" if self.notes else ""))
        self.degraded = "; ".join(self.notes)

    def realized(self, level: int | None = None) -> Allocation:
        i = self.level if level is None else level
        enc, pre, total = self.encode_sms[i], self.prefill_sms[i], self.total_sms
        if enc >= total:
            return Allocation(1.0, 0.0, i)
        return Allocation(enc / total, pre / total, i)

    @staticmethod
    def probe(device_index: int = 0) -> tuple[bool, str]:
        return _probe_default(device_index)

    def encode_stream(self, level: int | None = None) -> Any:
        return self._enc[self.level if level is None else level][0]

    def prefill_stream(self, level: int | None = None) -> Any:
        return self._pre[self.level if level is None else level][0]

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        stream, ctx = self._enc[self.level if level is None else level]
        return stream_scope(stream, sync, self._torch, self._entering(ctx))

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        stream, ctx = self._pre[self.level if level is None else level]
        return stream_scope(stream, sync, self._torch, self._entering(ctx))

    def _entering(self, ctx: Any) -> Callable[[], ContextManager[Any]] | None:
        """For a green stream: a scope that makes its context current (None: a plain stream,
        which lives in the primary context)."""
        if ctx is None:
            return None

        @contextlib.contextmanager
        def current():
            self._call("cuCtxPushCurrent", ctx)
            try:
                yield
            finally:
                self._call("cuCtxPopCurrent")
        return current

    def _call(self, name: str, *args: Any) -> Any:
        return check(getattr(self._drv, name)(*args), name)

    def _device_sm_resource(self) -> tuple[Any, Any]:
        dev = self._call("cuDeviceGet", self.device_index)
        return dev, self._call("cuDeviceGetDevResource", dev, self._drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)

    def _sm_count(self, share: float) -> int:
        return sm_split(self.total_sms, self.granularity, self.min_sms, share, self.rounding)

    def _make_level(self, share: float) -> tuple[tuple[Any, Any], tuple[Any, Any], int, int]:
        torch = self._torch
        n = self._sm_count(share)
        if share >= 1.0 or n >= self.total_sms:  # encode keeps the device, at high priority
            dev = f"cuda:{self.device_index}"
            return ((torch.cuda.Stream(dev, priority=-1), None), (torch.cuda.Stream(dev), None),
                    self.total_sms, self.total_sms)
        groups, n_groups, remaining = self._call("cuDevSmResourceSplitByCount", 1, self._sm, 0, n)
        if n_groups != 1:
            raise BackendUnavailable(f"SM split of {n} SMs returned {n_groups} groups")
        enc = self._green_stream(groups[0])
        try:
            group = self._prefill_group(remaining)
            pre, pre_sms = self._green_stream(group), group.sm.smCount
        except RuntimeError as e:  # a prefill group the driver will not make or turn into a context
            if self.strict:
                raise BackendUnavailable(f"share {share:g}: the driver refused the prefill group of the "
                                         f"{remaining.sm.smCount}-SM remainder ({e})") from e
            self.notes.append(f"share {share:g}: prefill time-slices ({e})")
            pre, pre_sms = (torch.cuda.Stream(f"cuda:{self.device_index}"), None), self.total_sms
        return enc, pre, groups[0].sm.smCount, pre_sms

    def _prefill_group(self, remaining: Any) -> Any:
        if self.prefill_group == "remainder":
            return remaining
        m = remaining.sm.smCount // self.granularity * self.granularity
        if m < self.min_sms:
            raise RuntimeError(f"{remaining.sm.smCount} SMs hold no group of {self.min_sms}")
        groups, n_groups, _leftover = self._call("cuDevSmResourceSplitByCount", 1, remaining, 0, m)
        if n_groups != 1:
            raise RuntimeError(f"SM split of {m} SMs returned {n_groups} groups")
        return groups[0]

    def _green_stream(self, resource: Any) -> tuple[Any, Any]:
        """(torch stream, its context made current) on a new green context over `resource`."""
        drv = self._drv
        desc = self._call("cuDevResourceGenerateDesc", [resource], 1)
        gctx = self._call("cuGreenCtxCreate", desc, self._dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        try:
            raw = self._call("cuGreenCtxStreamCreate", gctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        except RuntimeError:
            self._call("cuGreenCtxDestroy", gctx)
            raise
        self._handles.append((raw, gctx))
        ctx = self._call("cuCtxFromGreenCtx", gctx)
        return self._torch.cuda.ExternalStream(int(raw), device=self.device_index), ctx

    def close(self) -> None:
        """Destroy the green streams and contexts (after the device drains)."""
        if not getattr(self, "_handles", None):
            return
        self._torch.cuda.synchronize(self.device_index)
        for raw, ctx in reversed(self._handles):
            with contextlib.suppress(RuntimeError):
                self._call("cuStreamDestroy", raw)
            with contextlib.suppress(RuntimeError):
                self._call("cuGreenCtxDestroy", ctx)
        self._handles.clear()
