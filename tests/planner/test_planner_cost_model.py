"""Cost model: hand-computed step times and peaks for small plans (Notes [Planner time/memory model])."""

import pytest

from annotate_offload.planner._cost_model import LayerMeasurement, LinkBandwidth, predict

GB = 10**9


def layers(n, f=10.0, b=20.0, a=GB, c=GB // 10):
    return [LayerMeasurement(f, b, a, c, name=f"l{i}") for i in range(n)]


FAST = LinkBandwidth(1000.0, 1000.0)  # 1 GB in 1 ms
SLOW = LinkBandwidth(50.0, 50.0)  # 1 GB in 20 ms


def test_keep_all_is_sum_of_compute_and_of_saved_bytes():
    p = predict(layers(3), ["keep"] * 3, FAST)
    assert p.step_ms == 90.0
    assert p.peak_bytes == 3 * GB
    assert p.d2h_stall_ms == (0.0, 0.0, 0.0) and p.copy_ms == (0.0, 0.0, 0.0)


def test_hidden_offload_costs_no_time_and_frees_one_layer():
    p = predict(layers(4), ["offload", "keep", "keep", "keep"], FAST)
    assert p.step_ms == 120.0  # 1 ms copies hide behind 10 ms forward / 20 ms backward
    # F_1 = a0 (in flight until the entry of layer 2) + a1; F_3 = a1 + a2 + a3; B_1 = reloaded a0 + a1
    assert p.peak_bytes == 3 * GB
    assert p.copy_ms[0] == pytest.approx(2.0)


def test_d2h_that_cannot_hide_delays_forward_at_the_release_point():
    p = predict(layers(4), ["offload", "keep", "keep", "keep"], LinkBandwidth(25.0, 1000.0))
    # fwd: layer 0 runs 0-10 and its D2H (40 ms, starting with the layer) ends at 40; the entry of
    # layer 2 at 20 waits to 40; forward ends at 60. bwd: 80, 100; entry of layer 1 starts H2D (1 ms);
    # layer 1 ends at 120; layer 0 does not wait; ends at 140.
    assert p.d2h_stall_ms[0] == pytest.approx(20.0)
    assert p.h2d_stall_ms[0] == 0.0
    assert p.step_ms == pytest.approx(140.0)


def test_a_d2h_shorter_than_its_layer_plus_the_next_hides():
    # 20 ms of D2H starts with layer 0 and ends at 20, exactly when layer 2 enters: no stall
    p = predict(layers(4), ["offload", "keep", "keep", "keep"], SLOW)
    assert p.d2h_stall_ms[0] == 0.0 and p.step_ms == pytest.approx(120.0)


def test_h2d_that_cannot_hide_delays_backward():
    m = [LayerMeasurement(40.0, 5.0, GB, 0) for _ in range(4)]
    p = predict(m, ["offload", "keep", "keep", "keep"], SLOW)
    # fwd 160 (D2H of 20 ms hides behind layer 0 itself); bwd 165, 170; entry of layer 1 at 170: H2D to
    # 190; layer 1 ends 175; layer 0 waits to 190 and ends at 195.
    assert p.d2h_stall_ms[0] == 0.0
    assert p.h2d_stall_ms[0] == pytest.approx(15.0)
    assert p.step_ms == pytest.approx(195.0)


def test_d2h_copies_queue_on_one_stream():
    m = [LayerMeasurement(10.0, 100.0, GB, 0) for _ in range(5)]
    p = predict(m, ["offload", "offload", "keep", "keep", "keep"], LinkBandwidth(25.0, 1000.0))
    # D2H 40 ms each: layer 0's copy 0-40; layer 1's copy queues behind it, 40-80 (alone it would end at
    # 50). Layer 2 enters at 20 and waits to 40 (stall 20), runs 40-50; layer 3 waits from 50 to 80.
    assert p.d2h_stall_ms[:2] == (pytest.approx(20.0), pytest.approx(30.0))


def test_h2d_waits_for_its_own_d2h():
    m = [LayerMeasurement(10.0, 1.0, GB, 0) for _ in range(3)]
    p = predict(m, ["offload", "keep", "keep"], LinkBandwidth(25.0, 1000.0), release_lag=0)
    # release_lag=0: layer 1 enters at 10 and waits for the D2H to 40; fwd ends at 60; bwd 61, then the
    # reload (1 ms) at the entry of layer 1: 62 + 0 stall; total 63.
    assert p.d2h_stall_ms[0] == pytest.approx(30.0)
    assert p.step_ms == pytest.approx(63.0)


def test_recompute_adds_forward_to_backward_and_holds_the_input():
    p = predict(layers(3), ["recompute", "keep", "keep"], FAST)
    assert p.step_ms == 100.0
    # F_2 = c0 + a1 + a2 is the peak; B_0 = a0 + c0 is smaller
    assert p.peak_bytes == GB // 10 + 2 * GB


def test_recomputing_the_last_layer_does_not_lower_the_peak():
    keep = predict(layers(3), ["keep"] * 3, FAST)
    last = predict(layers(3), ["keep", "keep", "recompute"], FAST)
    assert last.peak_bytes == keep.peak_bytes + GB // 10  # B_2 = a0 + a1 + (a2 + c2)
    assert last.step_ms == keep.step_ms + 10.0


def test_recompute_offload_moves_only_the_input():
    p = predict(layers(4), ["recompute_offload", "keep", "keep", "keep"], SLOW)
    # input copy 0.1 GB = 2 ms hides; backward adds f0
    assert p.step_ms == 130.0
    assert p.peak_bytes == 3 * GB
    assert p.copy_ms[0] == pytest.approx(4.0)


@pytest.mark.parametrize(
    "choices, match",
    [
        (["keep"] * 3, "3 entries for 4 layers"),
        (["keep", "drop", "keep", "keep"], r"choices\[1\]='drop'"),
        (["keep", "keep", "keep", "offload"], r"choices\[3\]='offload'.*keep or recompute"),
        (["keep", "keep", "recompute_offload", "keep"], r"choices\[2\]"),  # release at layer 4 > last
    ],
)
def test_bad_plans_are_rejected(choices, match):
    with pytest.raises(ValueError, match=match):
        predict(layers(4), choices, FAST)


def test_release_lag_zero_allows_one_more_layer_and_exposes_the_copy():
    p = predict(layers(4), ["keep", "keep", "offload", "keep"], SLOW, release_lag=0)
    assert p.d2h_stall_ms[2] == pytest.approx(10.0)  # the 20 ms copy starts with layer 2, released after 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(forward_ms=-1.0), "forward_ms must be >= 0"),
        (dict(saved_bytes=float("nan")), "saved_bytes must be a finite number"),
        (dict(backward_ms=True), "backward_ms must be a finite number"),
    ],
)
def test_measurement_fields_are_validated(kwargs, match):
    base = dict(forward_ms=1.0, backward_ms=1.0, saved_bytes=1, checkpoint_input_bytes=1)
    base.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        LayerMeasurement(**base)


def test_bandwidth_must_be_positive():
    with pytest.raises(ValueError, match="d2h_gbps must be > 0"):
        LinkBandwidth(0.0, 1.0)
    with pytest.raises(ValueError, match="prefetch_layers must be an int >= 1"):
        predict(layers(3), ["keep"] * 3, FAST, prefetch_layers=0)


def test_an_offloaded_layer_keeps_its_unmoved_bytes_and_copies_only_the_rest():
    # saved tensors under the runtime's min_offload_numel stay on the GPU: a plan that counted them as
    # moved would promise a peak the run exceeds
    full = layers(4)
    part = [LayerMeasurement(10.0, 20.0, GB, GB // 10, unmoved_bytes=GB // 4, unmoved_input_bytes=GB // 10)
            for _ in range(4)]
    plan = ["offload", "keep", "keep", "keep"]
    a, b = predict(full, plan, SLOW), predict(part, plan, SLOW)
    assert b.copy_ms[0] == pytest.approx(0.75 * a.copy_ms[0])  # 3/4 of the bytes cross the link
    assert b.peak_bytes == a.peak_bytes + GB // 4  # at layer 3's forward: a1 + a2 + a3 plus layer 0's unmoved part
    rec = ["recompute_offload", "keep", "keep", "keep"]
    assert predict(part, rec, SLOW).copy_ms[0] == 0.0  # its whole input stays
    nothing = [LayerMeasurement(10.0, 20.0, GB, GB // 10, unmoved_bytes=GB) for _ in range(4)]
    assert predict(nothing, plan, FAST).peak_bytes == predict(nothing, ["keep"] * 4, FAST).peak_bytes
    with pytest.raises(ValueError, match="unmoved_bytes=2 exceeds saved_bytes=1"):
        LayerMeasurement(1.0, 1.0, 1, 1, unmoved_bytes=2)
