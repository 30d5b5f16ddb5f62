"""A GPU that is not there: the green-contexts driver and torch.cuda stand-ins of
hasctl.gpucheck.fakes made the partition backends' defaults, and a latency model for them."""
from __future__ import annotations


def fake_latency(b: int, share: float) -> float:
    return 0.01 * b / min(1.0, share / min(1.0, 0.15 * b))


def fake_gpu(monkeypatch, total: int = 132, fail_remainder_below: int = 0, align: int = 8):
    """Stand-ins for torch.cuda and the cuda.bindings driver (hasctl.gpucheck.fakes), made
    the module defaults so that select_backend builds on them; returns the driver's log."""
    from easerve.partition import green_contexts as m
    from easerve.partition import backends as sm_backends
    from hasctl.gpucheck.fakes import FakeDriver, fake_torch

    drv = FakeDriver(total, align, refuse_below=fail_remainder_below)
    torch = fake_torch(drv)
    monkeypatch.setattr(m, "_torch", lambda: torch)
    monkeypatch.setattr(sm_backends, "_torch", lambda: torch)  # the shared stream scope
    monkeypatch.setattr(m, "load_driver", lambda: drv)
    monkeypatch.setattr(m.GreenContextBackend, "probe",
                        staticmethod(lambda i=0: m.probe(i, driver=drv, torch=torch)))
    return drv.log
