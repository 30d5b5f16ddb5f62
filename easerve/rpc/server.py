"""serve(): a grpc.aio server with standard health, warm-up gating and a graceful drain.

Life of a server:
  bind + start, health NOT_SERVING  ->  await warmup()  ->  SERVING
  SIGTERM / SIGINT (or `stop` set)  ->  the drain (easerve.rpc.drain): NOT_SERVING, new calls
  refused UNAVAILABLE, every accepted call finishes (up to `drain_timeout_s`; past it those
  left end UNAVAILABLE)  ->  server.stop(grace_s)  ->  return (the process exits 0).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Sequence, TypeVar, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from easerve.rpc import malformed
from easerve.rpc.drain import Drain
from easerve.rpc.tls import NO_TLS, Tls, add_port, tls_of

log = logging.getLogger(__name__)
T = TypeVar("T")

# A callable that registers servicers on the server, or an (add_XServicer_to_server, servicer) pair.
Adder = Union[Callable[[grpc.aio.Server], None], tuple[Callable[[Any, grpc.aio.Server], None], Any]]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerOptions:
    """gRPC settings of a stage's server and of the channels it opens to its peers.

    Keepalive: channels ping a connection every `keepalive_time_ms` (also while no
    call is open, and without a cap on pings between data frames), so a dead peer is found
    on long idle streams; servers accept pings down to `min_ping_interval_ms` apart
    (gRPC's default, 5 minutes, answers a 30 s keepalive with GOAWAY too_many_pings)."""
    max_message_bytes: int = 256 << 20
    grace_s: float = 10.0          # after the drain: for streams that are not work (health watches)
    drain_timeout_s: float = 600.0  # the drain's hard bound (requests end by their deadline before it)
    keepalive_time_ms: int = 5_000  # a peer whose link went silent is UNAVAILABLE within ~10 s,
    keepalive_timeout_ms: int = 5_000  # inside a request's deadline (tests/reliability/test_netns.py)
    min_ping_interval_ms: int = 500
    tls: Tls = NO_TLS

    def __post_init__(self) -> None:
        if self.max_message_bytes < 4 << 20:
            raise ValueError(f"max_message_bytes must be >= 4 MiB, got {self.max_message_bytes}")
        if self.grace_s < 0 or self.drain_timeout_s < 0:
            raise ValueError(f"grace_s and drain_timeout_s must be >= 0 seconds, got {self.grace_s}, "
                             f"{self.drain_timeout_s}")
        if self.keepalive_time_ms <= 0 or self.keepalive_timeout_ms <= 0:
            raise ValueError(f"keepalive_time_ms and keepalive_timeout_ms must be > 0, got "
                             f"{self.keepalive_time_ms}, {self.keepalive_timeout_ms}")
        if not 0 < self.min_ping_interval_ms <= self.keepalive_time_ms:
            raise ValueError(f"min_ping_interval_ms must be in (0, keepalive_time_ms={self.keepalive_time_ms}], "
                             f"got {self.min_ping_interval_ms}: a server must accept its peers' keepalive pings")

    @classmethod
    def of(cls, cfg) -> ServerOptions:
        """From a stage config: --grace-s, --drain-timeout-s, --max-message-mb, --tls-*."""
        return cls(max_message_bytes=int(cfg.max_message_mb * (1 << 20)), grace_s=cfg.grace_s,
                   drain_timeout_s=cfg.drain_timeout_s, tls=tls_of(cfg))

    def channel_options(self) -> list[tuple[str, int]]:
        """Options for the channels that talk to peers (servers add `server_options`).
        Reconnect backoff is capped at 2 s (gRPC's default grows to 2 minutes): a peer that
        was down at start, or restarted, is used again within a poll or two."""
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", self.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000)]

    def server_options(self) -> list[tuple[str, int]]:
        """The server's: message limits, its own keepalive pings, and the pings it accepts."""
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", self.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", self.min_ping_interval_ms),
                ("grpc.http2.max_ping_strikes", 2),
                # no SO_REUSEPORT: a second server on a taken port must fail, not share its traffic
                ("grpc.so_reuseport", 0)]


class HealthState:
    """A handle a service keeps to turn its own health NOT_SERVING when it can no longer
    do its work (its engine died): callers then route around it, and a supervisor can
    restart it. `fail()` may be called from the event loop's thread at any time."""

    def __init__(self) -> None:
        self._servicer = None
        self._names: tuple[str, ...] = ()
        self.failed: str | None = None

    def _bind(self, servicer, names) -> None:
        self._servicer, self._names = servicer, tuple(names)

    def fail(self, reason: str) -> None:
        log.error("turning NOT_SERVING: %s", reason)
        self.failed = reason
        if self._servicer is not None:
            for name in self._names:
                asyncio.get_running_loop().create_task(self._servicer.set(name, NOT_SERVING))


async def serve(
    adders: Sequence[Adder],
    addr: str,
    *,
    health_services: Sequence[str] = (),
    warmup: Callable[[], Awaitable[None]] | None = None,
    grace_s: float | None = None,
    options: ServerOptions = ServerOptions(),
    stop: asyncio.Event | None = None,
    on_bound: Callable[[int], None] | None = None,
    health_state: HealthState | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    settle: Callable[[], Awaitable[None]] | None = None,
    drain_allows: Sequence[str] = (),
) -> None:
    """Serve until SIGTERM/SIGINT or `stop` is set, then drain. `addr` like "0.0.0.0:50051"
    (port 0 picks a free one, reported through `on_bound`). Health of "" and each name in
    `health_services` is NOT_SERVING until `warmup()` returns; if warmup raises, the server
    stops and the error propagates. TLS when `options.tls` serves it; `interceptors` see
    every call (the health service's too).

    Drain (easerve.rpc.drain, the same for every stage): health turns NOT_SERVING and new calls
    are refused UNAVAILABLE, but those to the methods in `drain_allows` (calls that finish work
    accepted before, e.g. decode's Submit of a reservation it holds); every accepted call is
    waited for, and `settle()` too when given (work that is not a gRPC call here, e.g. the
    gateway's HTTP requests), up to `options.drain_timeout_s`; calls still open then end
    UNAVAILABLE. Then the server stops, `grace_s` (default: options.grace_s) for the rest."""
    grace = options.grace_s if grace_s is None else grace_s
    drain = Drain(drain_allows)
    server = grpc.aio.server(options=options.server_options(), interceptors=[drain, *interceptors])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for adder in adders:
        _register(adder, server)
    names = ["", *health_services]
    for name in names:
        await health_servicer.set(name, NOT_SERVING)
    port = add_port(server, addr, options.tls)
    if port == 0:
        raise OSError(f"could not bind {addr}")
    await server.start()
    log.info("listening on %s (port %d%s)", addr, port, ", TLS" if options.tls.serving else "")
    if on_bound is not None:
        on_bound(port)
    stop = stop or asyncio.Event()
    restore = _install_signals(stop)
    try:
        await _warm(warmup, stop)
        freeze_startup_heap()
        if health_state is not None:
            health_state._bind(health_servicer, names)
        if health_state is None or health_state.failed is None:
            for name in names:
                await health_servicer.set(name, SERVING)
        log.info("serving %s", ", ".join(health_services) or "(no named services)")
        await stop.wait()
    finally:
        restore()
        await _drain(server, health_servicer, drain, options.drain_timeout_s, grace, settle)


def freeze_startup_heap() -> int:
    """Move every object alive now (the model, tokenizer, imported modules: hundreds of
    thousands) into the collector's permanent generation, so that a full collection under load
    scans only what requests made: without this one takes ~180 ms of a core on a stage process,
    holding the GIL (the gateway's event loop, a decode step), at whatever moment it falls.
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector", n)
    return n


def _register(adder: Adder, server: grpc.aio.Server) -> None:
    if isinstance(adder, tuple):  # a generated adder: unparseable requests answer INVALID_ARGUMENT
        add, servicer = adder
        malformed.register(add, servicer, server)
    else:
        adder(server)


async def _warm(warmup: Callable[[], Awaitable[None]] | None, stop: asyncio.Event) -> None:
    if warmup is None:
        return
    task = asyncio.ensure_future(warmup())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():  # asked to stop while warming up
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    task.result()


async def _drain(server: grpc.aio.Server, health_servicer, drain: Drain, bound_s: float, grace_s: float,
                 settle: Callable[[], Awaitable[None]] | None = None) -> None:
    answered = drain.answered  # counted from here: the calls the line below reports
    log.info("draining: NOT_SERVING, new calls refused; waiting for %d accepted call(s), up to %.0f s",
             drain.inflight, bound_s)
    await health_servicer.enter_graceful_shutdown()
    drain.begin()

    async def settled() -> None:
        if settle is not None:
            await settle()
        await drain.idle()
    try:
        await asyncio.wait_for(settled(), bound_s)
        log.info("settled: the work accepted before the drain is done (%d call(s) answered while draining)",
                 drain.answered - answered)
    except asyncio.TimeoutError:
        n = drain.cut(f"this instance stopped after draining for {bound_s:.0f} s (--drain-timeout-s); "
                      "retry the call on another instance")
        log.warning("the drain's bound of %.0f s passed: %d call(s) still open end UNAVAILABLE", bound_s, n)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drain.idle(), 5.0)
    await server.stop(grace_s)
    log.info("stopped")


def _install_signals(stop: asyncio.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set `stop` (main thread only; elsewhere this is a no-op)."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def restore() -> None:
        for s in installed:
            loop.remove_signal_handler(s)
    return restore


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None) -> T:
    """asyncio.run with uvloop when it is installed (or when use_uvloop=True)."""
    factory = None
    if use_uvloop is not False:
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            if use_uvloop:
                raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
