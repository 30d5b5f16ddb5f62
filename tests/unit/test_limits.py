import pytest

from easerve.rpc.errors import http_status
from easerve.errors import Overloaded
from easerve.stages.common.limits import InflightLimit


def test_refuses_past_the_limit_and_frees_on_exit():
    lim = InflightLimit(2, "gateway")
    with lim.admit(), lim.admit():
        with pytest.raises(Overloaded, match="limit of 2") as e:
            with lim.admit():
                pass
        assert http_status(e.value) == 429
    assert lim.inflight == 0
    with lim.admit():
        assert lim.inflight == 1


def test_frees_on_error_and_rejects_bad_limits():
    lim = InflightLimit(1, "prefill")
    with pytest.raises(RuntimeError):
        with lim.admit():
            raise RuntimeError("boom")
    assert lim.inflight == 0
    with pytest.raises(ValueError, match=">= 1"):
        InflightLimit(0, "encode")
