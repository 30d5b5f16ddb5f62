import pytest

from easerve.wire import protogen


def test_committed_stubs_match_protos():
    diffs = protogen.drift()
    assert not diffs, "stubs drifted from protos/easerve/v1: run `python -m easerve.wire.protogen`\n" + "\n".join(diffs)


def test_every_proto_has_its_stubs():
    names = {p.name for p in protogen.STUB_DIR.iterdir()}
    for proto in protogen.proto_files():
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert proto.stem + suffix in names


def test_stubs_import_as_package_and_declare_services():
    from easerve.wire.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, encode_pb2_grpc, gateway_pb2,
                            gateway_pb2_grpc, kv_pb2, kv_pb2_grpc, prefill_pb2_grpc, stage_pb2,
                            stage_pb2_grpc)

    assert common_pb2.DESCRIPTOR.package == "easerve.v1"
    methods = {
        gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]: {"Generate", "ListModels"},
        decode_pb2.DESCRIPTOR.services_by_name["Decode"]: {"Open", "Submit", "Stats", "Cancel"},
        stage_pb2.DESCRIPTOR.services_by_name["Stage"]: {"Load", "ShmProbe"},
        kv_pb2.DESCRIPTOR.services_by_name["KVStream"]: {"Push"},
    }
    for service, want in methods.items():
        assert set(service.methods_by_name) == want
    for mod in (gateway_pb2_grpc, decode_pb2_grpc, encode_pb2_grpc, prefill_pb2_grpc, kv_pb2_grpc, stage_pb2_grpc):
        assert not any(line.startswith("import ") and "_pb2" in line
                       for line in open(mod.__file__).read().splitlines())
    oneof = kv_pb2.KVTransfer.DESCRIPTOR.oneofs_by_name["location"]
    assert {f.name for f in oneof.fields} == {"inline", "shm", "cuda_ipc", "nccl", "grpc"}


def test_every_internal_request_carries_request_meta():
    from easerve.wire.v1 import decode_pb2, encode_pb2, prefill_pb2

    for msg in (encode_pb2.EncodeRequest, prefill_pb2.PrefillRequest, decode_pb2.DecodeRequest):
        field = msg.DESCRIPTOR.fields_by_name["meta"]
        assert field.message_type.full_name == "easerve.v1.RequestMeta"


def test_rewrite_imports_makes_bare_imports_absolute():
    src = "import common_pb2 as common__pb2\nimport grpc\n"
    assert protogen.rewrite_imports(src) == "from easerve.wire.v1 import common_pb2 as common__pb2\nimport grpc\n"


def test_check_exit_code(capsys):
    assert protogen.main(["--check"]) == 0
    with pytest.raises(SystemExit):
        protogen.main(["--bogus"])
