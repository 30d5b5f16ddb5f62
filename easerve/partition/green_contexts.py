"""CUDA green contexts as an SMBackend: per share level, one SM split made up front into an
encode group and the disjoint remainder for prefill, each with its own stream, so switching
level is picking a pre-created stream (no driver call). torch is imported lazily."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, ClassVar, ContextManager, Sequence

from easerve.policy.partitioner import DEFAULT_SHARES, Allocation
from easerve.partition.backends import BackendUnavailable, SMBackend, _check_levels, _stream_scope


def _torch() -> Any:
    import torch
    return torch


class _Supported:
    """`GreenContextBackend.SUPPORTED`, probed on first read (never at import)."""

    def __get__(self, obj: Any, owner: type) -> bool:
        return owner.probe()[0]


@functools.cache
def _probe_green(device_index: int) -> tuple[bool, str]:
    try:
        torch = _torch()
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if device_index >= torch.cuda.device_count():
        return False, f"no CUDA device {device_index} ({torch.cuda.device_count()} visible)"
    try:
        from torch.cuda import green_contexts as gcm
    except ImportError:
        return False, f"torch {torch.__version__} has no torch.cuda.green_contexts"
    try:
        gcm._ensure_supported()  # driver >= 12.8, cuda.bindings, not ROCm / Windows
    except AttributeError:
        pass
    except RuntimeError as e:
        return False, str(e)
    return True, f"green contexts on {torch.cuda.get_device_name(device_index)}"


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
    stream on the disjoint remainder, all created up front; `apply` only picks the index.
    Level 1.0 (or an encode group that would take every SM) uses two plain full-device
    streams, encode's at high priority: prefill then time-slices. `encode_sms` / `prefill_sms` hold what the driver
    actually granted (it may round down). The streams are custom CUDA streams: order work
    across them with CUDA events. `rounding` as in `sm_split`; `strict`: a prefill remainder
    the driver refuses raises instead of letting that level's prefill time-slice."""

    name = "green_contexts"
    dynamic = True
    SUPPORTED: ClassVar[bool] = _Supported()  # type: ignore[assignment]

    def __init__(self, levels: Sequence[float] = DEFAULT_SHARES, device_index: int = 0,
                 rounding: str = "up", strict: bool = False) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.rounding, self.strict = rounding, strict
        ok, why = self.probe(device_index)
        if not ok:
            raise BackendUnavailable(why)
        torch = _torch()
        self.device_index = device_index
        props = torch.cuda.get_device_properties(device_index)
        self._handles: list[Any] = []   # (raw stream, green ctx) to destroy on close
        self.notes: list[str] = []
        lv = _check_levels(levels)
        with torch.cuda.device(device_index):
            torch.empty(1, device=f"cuda:{device_index}")  # primary context current on this thread
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
        return _probe_green(device_index)

    def encode_stream(self, level: int | None = None) -> Any:
        return self._enc[self.level if level is None else level]

    def prefill_stream(self, level: int | None = None) -> Any:
        return self._pre[self.level if level is None else level]

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return _stream_scope(self.encode_stream(level), sync)

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return _stream_scope(self.prefill_stream(level), sync)

    def _device_sm_resource(self) -> tuple[Any, Any]:
        check, drv = _driver()
        dev = check(drv.cuDeviceGet(self.device_index))
        return dev, check(drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))

    def _sm_count(self, share: float) -> int:
        return sm_split(self.total_sms, self.granularity, self.min_sms, share, self.rounding)

    def _make_level(self, share: float) -> tuple[Any, Any, int, int]:
        torch = _torch()
        n = self._sm_count(share)
        if share >= 1.0 or n >= self.total_sms:  # encode keeps the device, at high priority
            dev = f"cuda:{self.device_index}"
            return (torch.cuda.Stream(dev, priority=-1), torch.cuda.Stream(dev),
                    self.total_sms, self.total_sms)
        check, drv = _driver()
        groups, n_groups, remaining = check(drv.cuDevSmResourceSplitByCount(1, self._sm, 0, n))
        if n_groups != 1:
            raise BackendUnavailable(f"SM split of {n} SMs returned {n_groups} groups")
        enc = self._green_stream(self._dev, groups[0])
        try:
            pre, pre_sms = self._green_stream(self._dev, remaining), remaining.sm.smCount
        except RuntimeError as e:  # remainder the driver will not turn into a context
            if self.strict:
                raise BackendUnavailable(f"share {share:g}: the driver refused the prefill remainder of "
                                   f"{remaining.sm.smCount} SMs ({e})") from e
            self.notes.append(f"share {share:g}: prefill time-slices ({e})")
            pre, pre_sms = torch.cuda.Stream(f"cuda:{self.device_index}"), self.total_sms
        return enc, pre, groups[0].sm.smCount, pre_sms

    def _green_stream(self, dev: Any, resource: Any) -> Any:
        check, drv = _driver()
        desc = check(drv.cuDevResourceGenerateDesc([resource], 1))
        ctx = check(drv.cuGreenCtxCreate(
            desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        try:
            raw = check(drv.cuGreenCtxStreamCreate(ctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        except RuntimeError:
            check(drv.cuGreenCtxDestroy(ctx))
            raise
        self._handles.append((raw, ctx))
        return _torch().cuda.ExternalStream(int(raw), device=self.device_index)

    def close(self) -> None:
        """Destroy the green streams and contexts (after the device drains)."""
        if not getattr(self, "_handles", None):
            return
        _torch().cuda.synchronize(self.device_index)
        check, drv = _driver()
        for raw, ctx in reversed(self._handles):
            with contextlib.suppress(RuntimeError):
                check(drv.cuStreamDestroy(raw))
            with contextlib.suppress(RuntimeError):
                check(drv.cuGreenCtxDestroy(ctx))
        self._handles.clear()


def _driver() -> tuple[Any, Any]:
    from torch.cuda._utils import _check_cuda_bindings, _cuda_bindings_driver
    return _check_cuda_bindings, _cuda_bindings_driver
