"""`hasctl k8s`: the manifests pass the Kubernetes schemas (kubernetes-validate, offline) and run
the argv the launcher would (hasctl.deployment.to_commands), modulo addresses and devices."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from hasctl.cli import main as hasctl_main
from hasctl.deployment import stop_s
from hasctl.deployment import HEALTH_SERVICES, PRESETS, STAGES, Deployment, Worker, to_commands
from hasctl.k8s import DESIRED_METRIC, METRICS_PORT, STAGE_PORTS, K8sOptions, manifests

kv = pytest.importorskip("kubernetes_validate")
K8S_VERSION = kv.utils.latest_version()
ADDR_FLAGS = ("--listen", "--http-listen", "--decode", "--prefill", "--encode")


def tuned_2x3x3() -> Deployment:
    """2 encode (different B, one co-locating prefill), 3 prefill, 3 decode on 8 GPUs."""
    enc = (Worker(device="cuda:0", flags={"max-batch": 4, "remote-fraction": 0.7, "colocate-prefill": True,
                                          "grace-s": 30, "drain-timeout-s": 90}),
           Worker(device="cuda:1", flags={"max-batch": 16, "batch-mode": "adaptive"}))
    pre = tuple(Worker(device=f"cuda:{i}", flags={"max-inflight": 64}) for i in (2, 3, 4))
    dec = tuple(Worker(device=f"cuda:{i}", flags={"max-running": 128}) for i in (5, 6, 7))
    return Deployment(name="tuned-2x3x3", model="/ckpt/Qwen2.5-VL-7B-Instruct", encode=enc, prefill=pre, decode=dec,
                      gateway=dataclasses.replace(Deployment().gateway, flags={"max-inflight": 256}))


CASES = {**PRESETS, "2x3x3": tuned_2x3x3(), "text-only": Deployment(name="text-only")}


def _by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def _mask(argv, device_map=lambda d: d):
    """argv with every address list masked (a pod names a Service, the launcher each instance),
    and the device mapped."""
    out = list(argv)
    if "--metrics-listen" in out:  # every stage pod serves /metrics on METRICS_PORT (the launcher: only if asked)
        i = out.index("--metrics-listen")
        del out[i:i + 2]
    for i in range(1, len(out)):
        if out[i - 1] in ADDR_FLAGS:
            out[i] = "<addresses>"
        if out[i - 1] == "--device":
            out[i] = device_map(out[i])
    return out


def _containers(objs):
    """process name (decode-0, ...) -> (workload object, ordinal): every instance's pod."""
    out = {}
    for o in _by_kind(objs, "StatefulSet"):
        stage = o["metadata"]["labels"]["app.kubernetes.io/component"]
        for ordinal in range(o["spec"]["replicas"]):
            out.setdefault(stage, []).append((o, ordinal))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_manifest_passes_the_kubernetes_schema(name):
    objs = manifests(CASES[name], K8sOptions(namespace="serving", image="registry.example/easerve:0.1"))
    for o in objs:
        kv.validate(o, K8S_VERSION, strict=True)  # raises ValidationError naming the bad field
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "Deployment", "Namespace", "Service", "StatefulSet"]
    assert all(o["metadata"].get("namespace") == "serving" for o in objs if o["kind"] != "Namespace")


@pytest.mark.parametrize("name", sorted(CASES))
def test_containers_run_the_launchers_argv_modulo_addresses_and_devices(name):
    d = CASES[name]
    objs = manifests(d, K8sOptions())
    pods = _containers(objs)
    ports = {f"{s}-{i}": 1 for s in STAGES for i in range(len(getattr(d, s)))} | {"gateway": 2, "gateway-http": 3}
    expected = {c.name: c for c in to_commands(d.with_model("/models"), "0.0.0.0", ports)}
    seen = set()
    for stage in STAGES:
        assert len(pods.get(stage, [])) == len(getattr(d, stage)), stage  # one pod per instance
        for i, w in enumerate(getattr(d, stage)):
            matches = [o for o, _ in pods[stage]
                       if _mask(o["spec"]["template"]["spec"]["containers"][0]["command"]) ==
                       _mask(expected[f"{stage}-{i}"].argv, lambda dev: "cuda:0" if dev.startswith("cuda") else dev)]
            assert matches, f"no pod runs {stage}-{i}: {expected[f'{stage}-{i}'].argv}"
            seen.add(matches[0]["metadata"]["name"])
    gw = _by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    served = gw[gw.index("--served-model-name") + 1]
    assert served == (d.model.rpartition("/")[2] if d.model else "qwen2.5-vl-tiny-s0")
    gw = gw[:gw.index("--served-model-name")] + gw[gw.index("--served-model-name") + 2:]
    assert _mask(gw) == _mask(expected["gateway"].argv)
    assert seen == {o["metadata"]["name"] for o in _by_kind(objs, "StatefulSet")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_peers_name_each_stage_by_its_headless_service_which_they_look_up_again(name):
    d = CASES[name]
    objs = manifests(d, K8sOptions(namespace="ns1"))
    services = {o["metadata"]["name"]: o for o in _by_kind(objs, "Service")}
    named = {s: [] for s in STAGES}
    for o in _by_kind(objs, "StatefulSet"):
        stage, sts = o["metadata"]["labels"]["app.kubernetes.io/component"], o["metadata"]["name"]
        assert o["spec"]["serviceName"] == sts and services[sts]["spec"]["clusterIP"] == "None"
        assert services[sts]["spec"]["publishNotReadyAddresses"] is False  # a draining pod leaves the records
        named[stage].append(f"{sts}.ns1.svc.cluster.local:{STAGE_PORTS[stage]}")
    commands = [o["spec"]["template"]["spec"]["containers"][0]["command"]
                for o in _by_kind(objs, "StatefulSet") + _by_kind(objs, "Deployment")]
    for argv in commands:
        gateway = argv[2] == "services.gateway"  # it reaches a monolith as every stage
        for flag in ("--decode", "--prefill", "--encode"):
            if flag in argv:
                want = named[flag[2:]] + (named["monolith"] if gateway else [])
                assert argv[argv.index(flag) + 1].split(",") == want, (argv, flag)
    gw = commands[-1]
    assert ("--encode" in gw) == bool(d.encode or d.monolith)
    if name == "2x3x3":  # 3 prefill instances, one name: the stages resolve it to every ready pod
        assert gw[gw.index("--prefill") + 1] == "easerve-prefill.ns1.svc.cluster.local:50053"


@pytest.mark.parametrize("name", sorted(CASES))
def test_headless_services_probes_grace_and_resources(name):
    d = CASES[name]
    objs = manifests(d, K8sOptions())
    services = {o["metadata"]["name"]: o for o in _by_kind(objs, "Service")}
    workers = {s: getattr(d, s) for s in STAGES}
    for o in _by_kind(objs, "StatefulSet"):
        stage = o["metadata"]["labels"]["app.kubernetes.io/component"]
        svc = services[o["metadata"]["name"]]
        assert svc["spec"]["clusterIP"] == "None"
        tmpl = o["spec"]["template"]
        assert svc["spec"]["selector"] == o["spec"]["selector"]["matchLabels"] == tmpl["metadata"]["labels"]
        pod = tmpl["spec"]
        (c,) = pod["containers"]
        port = int(c["command"][c["command"].index("--listen") + 1].rpartition(":")[2])
        assert svc["spec"]["ports"][0]["port"] == c["ports"][0]["containerPort"] == port
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": HEALTH_SERVICES[stage]}
        assert c["livenessProbe"]["grpc"]["port"] == c["startupProbe"]["grpc"]["port"] == port
        # removal: preStop sleeps while callers drop the pod (--peer-refresh-s 5 + a poll), then
        # SIGTERM starts the drain; the kubelet's SIGKILL comes only after its bound and the grace
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "6"]
        argv = c["command"]
        drain = float(argv[argv.index("--drain-timeout-s") + 1]) if "--drain-timeout-s" in argv else 600.0
        grace = float(argv[argv.index("--grace-s") + 1]) if "--grace-s" in argv else 10.0
        assert pod["terminationGracePeriodSeconds"] > 6 + drain + grace
        gpu = any(w.device.startswith("cuda") for w in workers[stage])
        if gpu:
            assert c["resources"]["limits"] == {"nvidia.com/gpu": 1}
            assert c["command"][c["command"].index("--device") + 1] == "cuda:0"
        else:
            assert int(c["resources"]["requests"]["cpu"]) >= 1 and "limits" not in c["resources"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert ("/models" in mounts) == bool(d.model)
    gw_svc = services["easerve-gateway"]
    assert {p["name"]: p["port"] for p in gw_svc["spec"]["ports"]} == {"grpc": d.gateway.grpc_port,
                                                                       "http": d.gateway.http_port}
    assert gw_svc["spec"].get("clusterIP") != "None"


def test_a_hub_id_pod_fetches_into_hf_home_with_the_token_secret():
    objs = manifests(tuned_2x3x3().with_model("Org/Name@v1"), K8sOptions(hf_home_claim="hf-cache"))
    pods = [o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")]
    assert len(pods) == 5  # two encode groups, prefill, decode and the gateway
    for pod in pods:
        c = pod["containers"][0]
        assert c["command"][c["command"].index("--model") + 1] == "Org/Name@v1"
        assert {"name": "hf-home", "mountPath": "/hf-home"} in c["volumeMounts"]
        assert {"name": "hf-home", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
        assert not any(v.get("persistentVolumeClaim", {}).get("claimName") == "easerve-model" for v in pod["volumes"])
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_HOME"]["value"] == "/hf-home"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}
    for o in objs:
        kv.validate(o, K8S_VERSION, strict=True)
    emptydir = manifests(tuned_2x3x3().with_model("Org/Name"))
    pod = next(o for o in emptydir if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert {"name": "hf-home", "emptyDir": {}} in pod["volumes"]


def test_grace_follows_the_stage_flag_and_the_configmap_holds_the_deployment():
    d = tuned_2x3x3()
    objs = manifests(d, K8sOptions())
    colocated = next(o for o in _by_kind(objs, "StatefulSet")
                     if "--colocate-prefill" in o["spec"]["template"]["spec"]["containers"][0]["command"])
    assert stop_s(d.encode[0].flags) == 120.0 and stop_s(d.encode[1].flags) == 610.0
    assert 126 < colocated["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] < 610
    (cm,) = _by_kind(objs, "ConfigMap")
    assert Deployment.from_dict(yaml.safe_load(cm["data"]["deployment.yaml"])) == d
    # two encode workers with different flags: two StatefulSets; 3 equal prefill: one of 3 replicas
    sts = {o["metadata"]["name"]: o["spec"]["replicas"] for o in _by_kind(objs, "StatefulSet")}
    assert sts == {"easerve-encode-0": 1, "easerve-encode-1": 1, "easerve-prefill": 3, "easerve-decode": 3}
    # the encode that co-locates prefill waits for decode and prefill, the other for prefill only
    waits = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["initContainers"][0]["command"][-1]
             for o in _by_kind(objs, "StatefulSet") if o["metadata"]["name"].startswith("easerve-encode")}
    assert "easerve.v1.Decode" in waits["easerve-encode-0"] and "easerve.v1.Decode" not in waits["easerve-encode-1"]


def test_cli_writes_valid_manifests_to_a_folder(tmp_path, capsys):
    f = tuned_2x3x3().dump(tmp_path / "best.yaml")
    out = tmp_path / "k8s"
    assert hasctl_main(["k8s", "--deployment", str(f), "--namespace", "prod", "--image", "reg/easerve:1",
                        "--out", str(out)]) == 0
    assert f"wrote {len(list(out.glob('*.yaml')))} manifests" in capsys.readouterr().out
    files = sorted(out.glob("*.yaml"))
    assert len(files) == len(manifests(tuned_2x3x3(), K8sOptions(namespace="prod", image="reg/easerve:1")))
    for p in files:
        o = yaml.safe_load(p.read_text())
        kv.validate(o, K8S_VERSION, strict=True)
        for c in (o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
            assert c["image"] == "reg/easerve:1"
    assert hasctl_main(["k8s", "--preset", "default"]) == 0
    docs = [x for x in yaml.safe_load_all(capsys.readouterr().out) if x]
    assert [o["kind"] for o in docs][:2] == ["Namespace", "ConfigMap"]


@pytest.mark.parametrize("kw", [{"namespace": "Bad_NS"}, {"image": ""}, {"gateway_service_type": "Ingress"}])
def test_bad_options_say_what_to_change(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        K8sOptions(**kw)


def test_cli_reports_a_bad_deployment_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: [{device: tpu}]\n")
    assert hasctl_main(["k8s", "--deployment", str(bad)]) == 2
    assert "decode[0].device" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_pod_is_annotated_for_prometheus_on_the_port_it_serves_metrics_on(name):
    objs = manifests(CASES[name], K8sOptions())
    for o in _by_kind(objs, "StatefulSet") + _by_kind(objs, "Deployment"):
        tmpl = o["spec"]["template"]
        ann, (c,) = tmpl["metadata"]["annotations"], tmpl["spec"]["containers"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        if "--metrics-listen" in c["command"]:
            assert c["command"][c["command"].index("--metrics-listen") + 1] == f"0.0.0.0:{METRICS_PORT}"
            assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"]
            assert ann["prometheus.io/port"] == str(METRICS_PORT)
        else:  # the gateway: /metrics on its HTTP port
            assert ann["prometheus.io/port"] == str(CASES[name].gateway.http_port)


@pytest.mark.parametrize("name", ["2x3x3", "default", "colocated"])
def test_autoscale_writes_a_valid_hpa_per_stage_on_desired_instances(name):
    objs = manifests(CASES[name], K8sOptions(autoscale=(1, 4)))
    hpas = _by_kind(objs, "HorizontalPodAutoscaler")
    for o in hpas:
        kv.validate(o, K8S_VERSION, strict=True)
    stages = [o["metadata"]["labels"]["app.kubernetes.io/component"] for o in hpas]
    assert sorted(stages) == sorted({s for s in STAGES if s != "monolith" and getattr(CASES[name], s)})
    sts = {o["metadata"]["name"] for o in _by_kind(objs, "StatefulSet")}
    for o, stage in zip(hpas, stages):
        spec = o["spec"]
        assert spec["scaleTargetRef"]["kind"] == "StatefulSet" and spec["scaleTargetRef"]["name"] in sts
        assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
        (m,) = spec["metrics"]
        assert m["external"]["metric"] == {"name": DESIRED_METRIC, "selector": {"matchLabels": {"stage": stage}}}
        assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert not _by_kind(manifests(CASES[name], K8sOptions()), "HorizontalPodAutoscaler")


@pytest.mark.parametrize("bad", ["3", "0:2", "4:2", "a:b"])
def test_autoscale_flag_says_what_to_write(bad, capsys):
    assert hasctl_main(["k8s", "--preset", "default", "--autoscale", bad]) == 2
    assert "--autoscale must be MIN:MAX" in capsys.readouterr().err
