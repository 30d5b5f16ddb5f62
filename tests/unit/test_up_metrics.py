"""`hasctl up` serves every stage's /metrics (encode's /trace too) on ports it prints, by default."""
from __future__ import annotations

from hasctl.deployment import STAGES, Worker, preset
from hasctl.launch import Stack
from hasctl.up_cmd import _print_endpoints


def _argv_flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_every_stage_process_gets_a_metrics_port_and_up_prints_them(tmp_path, capsys):
    d = preset("colocated").with_model(str(tmp_path / "ckpt")).with_gateway_ports(0, 0)
    stack = Stack(d, run_dir=tmp_path / "run", metrics=True)
    e = stack.endpoints
    procs = [f"{s}-{i}" for s in STAGES for i in range(len(getattr(d, s)))]
    assert sorted(e.metrics) == sorted([*procs, "gateway"])
    ports = set()
    for name in procs:
        argv = stack._procs[name].cmd.argv
        listen = _argv_flag(argv, "--metrics-listen")
        assert listen.startswith("127.0.0.1:")  # the stack's --host: loopback unless told otherwise
        assert e.metrics[name] == "http://127.0.0.1:" + listen.rpartition(":")[2]
        ports.add(listen)
    assert len(ports) == len(procs)
    _print_endpoints(stack)
    out = capsys.readouterr().out
    for name in procs:
        assert f"{e.metrics[name]}/metrics" in out
    enc = next(n for n in procs if n.startswith("encode"))
    assert f"{e.metrics[enc]}/trace" in out


def test_a_deployments_own_metrics_listen_is_kept_and_metrics_can_be_off(tmp_path):
    d = preset("default").with_model(str(tmp_path / "ckpt")).with_gateway_ports(0, 0)
    d = d.__class__(**{**vars(d), "decode": (Worker(flags={"metrics-listen": "127.0.0.1:9999"}),)})
    stack = Stack(d, run_dir=tmp_path / "a", metrics=True)
    assert stack.endpoints.metrics["decode-0"] == "http://127.0.0.1:9999"
    off = Stack(d, run_dir=tmp_path / "b", metrics=False)
    assert set(off.endpoints.metrics) == {"gateway", "decode-0"}
    assert _argv_flag(off._procs["encode-0"].cmd.argv, "--metrics-listen") is None


def test_up_turns_metrics_on_unless_told_not_to():
    from hasctl.cli import build_parser
    assert build_parser(["up"]).parse_args(["up"]).no_metrics is False
    assert build_parser(["up"]).parse_args(["up", "--no-metrics"]).no_metrics is True
