"""The kernels' step stamps (mooncake/ep/cuda/trace.h) as the module shows
them, without a GPU: a build without MOONCAKE_EP_TRACE says so and refuses
to reset or read, naming the option; the points are the steps the probes
print, in the order a dispatch reaches them."""

import pytest

pytestmark = pytest.mark.timeout(60)

ep_ipc = pytest.importorskip("mooncake._ep_ipc", reason="the native module mooncake._ep_ipc is not built "
                                                        "(it needs the CUDA toolkit at build time)")

STEPS = ["layout start", "layout end", "rows start", "rows sent", "layout waited", "signalled", "wait start",
         "heard", "laid out", "handed over", "copied", "rows end"]


def test_the_points_are_a_dispatchs_steps_in_order():
    assert ep_ipc.trace_points() == STEPS


def test_a_build_without_stamps_refuses_to_reset_or_read():
    if ep_ipc.trace_enabled():
        pytest.skip("this build stamps (MOONCAKE_EP_TRACE=ON): reset and read need a GPU")
    with pytest.raises(RuntimeError, match="MOONCAKE_EP_TRACE=OFF"):
        ep_ipc.trace_reset()
    with pytest.raises(RuntimeError, match="MOONCAKE_EP_TRACE=OFF"):
        ep_ipc.trace_read()
