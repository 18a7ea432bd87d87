"""Cost model: hand-computed step times and peaks (Notes [Planner time model], [Planner memory model])."""

import pytest

from annotate_offload.planner._cost_model import LayerMeasurement, LinkBandwidth, StepMeasurement, predict

GB = 10**9


def layers(n, f=10.0, b=20.0, a=GB, c=GB // 10, **kw):
    return [LayerMeasurement(f, b, a, c, name=f"l{i}", **kw) for i in range(n)]


FAST = LinkBandwidth(1000.0, 1000.0)  # 1 GB in 1 ms
SLOW = LinkBandwidth(50.0, 50.0)  # 1 GB in 20 ms


def test_keep_all_is_the_sum_of_compute_and_the_peak_is_at_the_turn():
    p = predict(layers(3), ["keep"] * 3, FAST)
    assert p.step_ms == 90.0 and p.layer_ms == (30.0, 30.0, 30.0)
    # bwd_2 = a0 + a1 (held) + c (output gradient) + a2 (its own saved tensors)
    assert p.peak_bytes == 3 * GB + GB // 10
    assert p.layer_peak_bytes == (GB + GB // 10, 2 * GB + GB // 10, 3 * GB + GB // 10)


def test_static_bytes_rest_of_the_step_and_peaks_add():
    step = StepMeasurement(static_bytes=5 * GB, other_ms=7.0)
    m = layers(3, forward_peak_bytes=GB, backward_peak_bytes=GB // 4)
    p = predict(m, ["keep"] * 3, FAST, step)
    assert p.step_ms == 97.0
    # fwd_2 = static + a0 + a1 + c2 + F+; bwd_2 = static + a0 + a1 + c2 + a2 + B+ (larger)
    assert p.peak_bytes == 5 * GB + 3 * GB + GB // 10 + GB // 4


def test_gradients_accumulate_in_backward_and_the_optimizer_step_holds_them_all():
    m = layers(3, a=GB, c=0, grad_bytes=GB)
    p = predict(m, ["keep"] * 3, FAST, StepMeasurement(other_grad_bytes=GB // 2))
    # bwd_j = other grads + grads of layers >= j + a_{<j} + a_j: 4.5 GB each; the optimizer step: 3.5 GB
    assert p.layer_peak_bytes == (GB // 2 + 4 * GB,) * 3 and p.peak_bytes == 4 * GB + GB // 2
    rec = predict(m, ["recompute"] * 3, FAST, StepMeasurement())
    # recompute frees what is held but the gradients stay: the peak moves to layer 0's backward
    assert rec.layer_peak_bytes == (4 * GB, 3 * GB, 2 * GB)


def test_a_hidden_offload_costs_no_time_and_frees_its_layer():
    p = predict(layers(4), ["offload", "keep", "keep", "keep"], FAST)
    assert p.step_ms == 120.0  # 1 ms copies hide behind 10 ms forwards and 20 ms backwards
    keep = predict(layers(4), ["keep"] * 4, FAST)
    assert keep.peak_bytes - p.peak_bytes == GB


def test_a_d2h_that_cannot_hide_delays_forward_at_the_release_point():
    p = predict(layers(4), ["offload", "keep", "keep", "keep"], LinkBandwidth(25.0, 1000.0))
    # layer 0's D2H (40 ms, from 0) ends at 40; layer 2 enters at 20 and waits to 40; forward ends at 60,
    # backward adds 80 (the 1 ms reload at the entry of layer 1 hides): 140
    assert p.step_ms == pytest.approx(140.0)
    assert p.layer_ms[2] == pytest.approx(20.0 + 10.0 + 20.0)


def test_an_h2d_that_cannot_hide_delays_backward():
    m = [LayerMeasurement(40.0, 5.0, GB, 0) for _ in range(4)]
    p = predict(m, ["offload", "keep", "keep", "keep"], SLOW)
    # fwd 160; bwd 165, 170; entry of layer 1 at 170 starts the 20 ms reload; layer 0 waits to 190: 195
    assert p.step_ms == pytest.approx(195.0)


def test_d2h_copies_queue_on_one_stream():
    m = [LayerMeasurement(10.0, 100.0, GB, 0) for _ in range(5)]
    p = predict(m, ["offload", "offload", "keep", "keep", "keep"], LinkBandwidth(25.0, 1000.0))
    # copies 0-40 and 40-80: layer 2 waits from 20 to 40, layer 3 from 50 to 80; forward ends at 100
    assert sum(p.layer_ms) == pytest.approx(p.step_ms) and p.step_ms == pytest.approx(100.0 + 500.0)


def test_a_larger_release_lag_hides_a_slow_copy_and_holds_it_longer():
    m = layers(6, forward_peak_bytes=5 * GB)  # the forward phase is the peak of each layer
    plan = ["offload", "keep", "keep", "keep", "keep", "keep"]
    lag1 = predict(m, plan, LinkBandwidth(25.0, 1000.0), release_lag=1)
    lag3 = predict(m, plan, LinkBandwidth(25.0, 1000.0), release_lag=3)
    assert lag1.step_ms == pytest.approx(180.0 + 20.0) and lag3.step_ms == pytest.approx(180.0)
    # layer 0's bytes are on the device until the entry of layer 2 (lag 1) or 4 (lag 3)
    assert lag3.layer_peak_bytes[3] - lag1.layer_peak_bytes[3] == GB


def test_recompute_adds_the_forward_and_holds_the_input():
    p = predict(layers(3), ["recompute", "keep", "keep"], FAST)
    assert p.step_ms == 100.0
    assert p.layer_peak_bytes[2] == GB // 10 + GB + GB // 10 + GB  # c0 held, a1, output gradient, a2
    rec_offload = predict(layers(4), ["recompute_offload", "keep", "keep", "keep"], SLOW)
    assert rec_offload.step_ms == 130.0  # 0.1 GB input copies hide


def test_a_selective_layer_holds_its_input_and_kept_outputs_and_costs_its_measured_time():
    m = layers(3, selective_bytes=GB // 5, selective_ms=24.0, selective_peak_bytes=GB // 2)
    p = predict(m, ["selective", "keep", "keep"], FAST)
    assert p.step_ms == 3 * 10.0 + 24.0 + 2 * 20.0
    assert p.layer_peak_bytes[2] == (GB // 10 + GB // 5) + GB + GB // 10 + GB  # c0 + s0 held, a1, c3, a2
    # bwd_0 = c0 + s0 + S+_0 + the output gradient c1
    assert p.layer_peak_bytes[0] == GB // 10 + GB // 5 + GB // 2 + GB // 10
    # unmeasured: a selective layer keeps all it saves and costs a full recompute (never chosen)
    plain = layers(1, recompute_ms=33.0, recompute_peak_bytes=7)[0]
    assert (plain.selective_bytes, plain.selective_ms, plain.selective_peak_bytes) == (GB, 33.0, 7)
    with pytest.raises(ValueError, match="selective_ms must be >= 20.0"):
        layers(1, selective_ms=19.0)
    with pytest.raises(ValueError, match="selective_bytes must be >= 0"):
        layers(1, selective_bytes=-1)


def test_a_selective_offload_layer_moves_its_input_and_kept_outputs_and_reloads_them_for_its_rerun():
    m = layers(4, selective_bytes=GB // 5, selective_ms=24.0, selective_peak_bytes=GB // 2,
               unmoved_selective_bytes=GB // 20)
    assert m[0].moved_bytes("selective_offload") == GB // 10 + GB // 5 - GB // 20
    p = predict(m, ["selective_offload", "keep", "keep", "keep"], SLOW)
    assert p.step_ms == 4 * 10.0 + 24.0 + 3 * 20.0  # 0.25 GB (12.5 ms) hides behind layer 1's forward
    # bwd_2: what stays of layer 0 (its reload starts at layer 1), a1, the output gradient c3, a2; bwd_0 has it back
    assert p.layer_peak_bytes[2] == GB // 20 + GB + GB // 10 + GB
    assert p.layer_peak_bytes[0] == GB // 10 + GB // 5 + GB // 2 + GB // 10
    with pytest.raises(ValueError, match="unmoved_selective_bytes=.* exceeds selective_bytes"):
        layers(1, selective_bytes=1, unmoved_selective_bytes=2)


def test_autocast_holds_a_recomputed_layers_weight_casts_to_the_end_of_forward():
    m = layers(3, cast_bytes=GB // 5, forward_peak_bytes=5 * GB)  # the forward phase is each layer's peak
    rec = predict(m, ["recompute", "recompute", "keep"], FAST)
    plain = predict(layers(3, forward_peak_bytes=5 * GB), ["recompute", "recompute", "keep"], FAST)
    diff = [a - b for a, b in zip(rec.layer_peak_bytes, plain.layer_peak_bytes)]
    assert diff[0] == 0 and diff[2] == 2 * GB // 5  # layer 2's forward: both earlier layers' casts are cached


def test_unmoved_bytes_stay_on_the_device():
    part = layers(4, unmoved_bytes=GB // 4)
    plan = ["offload", "keep", "keep", "keep"]
    assert predict(part, plan, SLOW).peak_bytes == predict(layers(4), plan, SLOW).peak_bytes + GB // 4
    with pytest.raises(ValueError, match="unmoved_bytes=2 exceeds saved_bytes=1"):
        LayerMeasurement(1.0, 1.0, 1, 1, unmoved_bytes=2)


def test_the_optimizer_split_moves_whole_tensors_in_order_as_megatron():
    step = StepMeasurement(param_numels=(10, 30, 60), param_state_bytes=(80, 240, 480), device_ms=1e6, host_ms=3e7)
    assert [step.host_tensors(f) for f in (0.0, 0.1, 0.11, 0.4, 0.41, 1.0)] == [0, 1, 2, 2, 3, 3]
    assert all(step.host_tensors(step.fraction(m)) == m for m in range(4))
    assert step.fewest_host_tensors(0) == 0 and step.fewest_host_tensors(81) == 2 and step.fewest_host_tensors(801) is None
    m = layers(3)
    base, half = predict(m, ["keep"] * 3, FAST, step), predict(m, ["keep"] * 3, FAST, step, offload_fraction=0.35)
    assert base.peak_bytes - half.peak_bytes == 320  # the first two tensors' state is on the host
    assert half.optimizer_ms == pytest.approx((60 * 1e6 + 40 * 3e7) / 1e9) and half.offload_fraction == step.fraction(2)
    assert half.step_ms == pytest.approx(90.0 + half.optimizer_ms)


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


def test_bad_schedule_bandwidth_and_fraction():
    with pytest.raises(ValueError, match="d2h_gbps must be > 0"):
        LinkBandwidth(0.0, 1.0)
    with pytest.raises(ValueError, match="prefetch_layers must be None or an int >= 1"):
        predict(layers(3), ["keep"] * 3, FAST, prefetch_layers=0)
    with pytest.raises(ValueError, match="offload_fraction must be in"):
        predict(layers(3), ["keep"] * 3, FAST, offload_fraction=1.5)
    with pytest.raises(ValueError, match="one entry per parameter"):
        StepMeasurement(param_numels=(1,), param_state_bytes=())


def test_the_head_after_the_last_layer_counts_and_can_hold_the_peak():
    # a large-vocabulary head: outputs 3 GB held through the backward, 2 GB saved by the head, 1 GB of
    # output gradient at the start of the backward
    step = StepMeasurement(static_bytes=GB, other_grad_bytes=GB // 2, output_bytes=3 * GB, head_saved_bytes=2 * GB,
                           head_forward_peak_bytes=GB // 4, head_backward_peak_bytes=GB)
    m = layers(3, a=GB, c=GB // 10)
    p = predict(m, ["keep"] * 3, FAST, step)
    # bwd_head = static + other grads + a0 + a1 + a2 + out + h + H+b
    assert p.peak_bytes == GB + GB // 2 + 3 * GB + 3 * GB + 2 * GB + GB
    rec = predict(m, ["recompute"] * 3, FAST, step)
    assert rec.peak_bytes == GB + GB // 2 + 3 * (GB // 10) + 3 * GB + 2 * GB + GB
    # the outputs stay held in every layer's backward
    assert p.layer_peak_bytes[0] == predict(m, ["keep"] * 3, FAST, StepMeasurement(
        static_bytes=GB, other_grad_bytes=GB // 2)).layer_peak_bytes[0] + 3 * GB


def test_a_recomputed_layer_costs_its_measured_recompute_time_and_peak():
    m = layers(2, a=GB, c=GB // 10, recompute_ms=25.0, recompute_peak_bytes=GB // 2)
    p = predict(m, ["recompute"] * 2, FAST)
    assert p.step_ms == 2 * 10.0 + 2 * 25.0
    # bwd_1 = c0 (held) + c1 (output gradient) + c1 (input) + R+_1
    assert p.peak_bytes == 3 * (GB // 10) + GB // 2
    # unmeasured: the forward rerun before the backward, and the larger of its forward and backward peaks
    plain = LayerMeasurement(10.0, 20.0, GB, 0, forward_peak_bytes=2 * GB, backward_peak_bytes=GB // 4)
    assert (plain.recompute_ms, plain.recompute_peak_bytes) == (30.0, 2 * GB)
    assert LayerMeasurement(10.0, 20.0, GB, 0, backward_peak_bytes=GB // 4).recompute_peak_bytes == GB + GB // 4
    with pytest.raises(ValueError, match="recompute_ms must be >= 20.0"):  # a rerun is never cheaper than none
        LayerMeasurement(10.0, 20.0, GB, 0, recompute_ms=19.0)


def test_a_backward_peak_after_the_saved_tensors_are_freed_is_negative_down_to_the_gradients():
    m = layers(1, a=GB, c=0, grad_bytes=GB, backward_peak_bytes=-GB // 2)
    # bwd_0 = g0 + a0 + B+ (its gradients outweigh what it freed before its peak)
    assert predict(m, ["keep"], FAST).peak_bytes == GB + GB // 2
    with pytest.raises(ValueError, match="backward_peak_bytes must be >= -5"):
        LayerMeasurement(1.0, 1.0, 10, 10, grad_bytes=5, backward_peak_bytes=-6)
    with pytest.raises(ValueError, match="recompute_peak_bytes must be >= 0"):
        LayerMeasurement(1.0, 1.0, 10, 10, recompute_peak_bytes=-1)
    with pytest.raises(TypeError, match="backward_peak_bytes must be a finite number"):
        LayerMeasurement(1.0, 1.0, 10, 10, backward_peak_bytes="1")
