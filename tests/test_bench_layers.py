"""bench.layers: onnxruntime's profiled nodes matched to jitbyoc's profiled regions."""

import pytest

from bench.layers import compatible, match, ort_layer, round_shares, table
from jitbyoc.profile import Row


def node(name, x, w, out, op="Conv", extra=(), dur=100.0):
    shapes = [{"float": list(x)}, {"float": list(w)}, *({"float": list(e)} for e in extra)]
    return {"cat": "Node", "name": f"{name}_kernel_time", "dur": dur,
            "args": {"op_name": op, "input_type_shape": shapes, "output_type_shape": [{"float": list(out)}]}}


def region(shapes, calls, seconds, macs_per_call):
    return Row(name="jitbyoc_x", owner="jitbyoc", ops="relax.nn.conv2d", shapes=shapes, calls=calls,
               seconds=seconds, gflop=2 * macs_per_call * calls / 1e9)


def test_a_conv_node_is_named_by_its_kernel_channels_map_and_residual():
    key, name, kind = ort_layer(node("c", (1, 64, 56, 56), (256, 64, 1, 1), (1, 256, 56, 56),
                                     extra=[(256,), (1, 256, 56, 56)]))
    assert (key, name, kind) == (((1, 256, 56, 56), 64, 1), "1x1 64->256 @56x56 +sum", "1x1 conv")
    key, name, kind = ort_layer(node("d", (1, 96, 56, 56), (96, 1, 3, 3), (1, 96, 28, 28)))
    assert (name, kind) == ("3x3 96->96 @28x28 g96", "grouped conv")
    assert ort_layer(node("r", (1, 8), (1, 8), (1, 8), op="Relu")) is None


def test_padded_channels_match_but_other_shapes_do_not():
    # onnxruntime's blocked layout reports MobileNet's 24 channels as 32
    jit = ((1, 144, 56, 56), 144 * 56 * 56 * 24)
    assert compatible(((1, 144, 56, 56), 32, 1), jit)
    assert not compatible(((1, 144, 56, 56), 48, 1), jit)  # 24 more input channels
    assert not compatible(((1, 144, 28, 28), 32, 1), jit)  # another map
    assert not compatible(((1, 144, 56, 56), 32, 9), jit)  # a 3x3 reads 9x the products


def test_a_round_sums_nodes_and_regions_of_one_layer_and_keeps_the_unmatched():
    layers: dict = {}
    events = [node("a", (1, 64, 56, 56), (256, 64, 1, 1), (1, 256, 56, 56), dur=500.0),
              node("b", (1, 64, 56, 56), (256, 64, 1, 1), (1, 256, 56, 56), dur=700.0),
              node("b", (1, 64, 56, 56), (256, 64, 1, 1), (1, 256, 56, 56), dur=900.0),
              node("c", (1, 3, 224, 224), (64, 3, 7, 7), (1, 64, 112, 112), dur=1000.0)]
    macs = 256 * 56 * 56 * 64
    rows = [region("1x64x56x56, 256x64x1x1 -> 1x256x56x56", 1, 0.4e-3, macs),
            region("1x64x56x56, 256x64x1x1, 1x256x56x56 -> 1x256x56x56", 1, 0.6e-3, macs),
            region("1x2x3 -> 1x2x3", 1, 1e-6, 0)]  # no products: not a layer
    match(layers, rows, events)
    one = layers[((1, 256, 56, 56), macs)]
    assert one.jit == {0: pytest.approx(1.0e-3)} and one.ort == {0: pytest.approx(0.5e-3 + 0.8e-3)}
    assert one.calls == 2 and one.kind == "1x1 conv" and one.flops == 2 * macs
    stem = layers[((1, 64, 112, 112), 3, 49)]
    assert stem.jit == {} and stem.ort == {0: pytest.approx(1e-3)}
    assert stem.flops == 2 * 64 * 112 * 112 * 3 * 49
    text = table(layers, peak=100.0, top=0)
    assert "1x1 64->256 @56x56" in text and "7x7 3->64 @112x112" in text
    # per kind: only layers both ran; 2 * 102.8 MFLOP in 1 ms against 1.3 ms
    kind_line = next(line for line in text.splitlines() if line.strip().startswith("1x1 conv"))
    assert kind_line.rstrip().endswith(f"{1.0 / 1.3:5.2f}")



def test_each_round_is_a_share_of_the_peak_measured_in_that_round():
    layers: dict = {}
    macs = 256 * 56 * 56 * 64  # 102.76 MFLOP per call
    for r, (jit_s, ort_s) in enumerate([(1.0e-3, 1.3e-3), (2.0e-3, 2.6e-3)]):  # round 1: all at half speed
        match(layers, [region("1x64x56x56, 256x64x1x1 -> 1x256x56x56", 1, jit_s, macs)],
              [node("a", (1, 64, 56, 56), (256, 64, 1, 1), (1, 256, 56, 56), dur=ort_s * 1e6)], r)
    # round 1's peak was half round 0's too: both rounds are the same share of their own
    line = next(row for row in round_shares(layers, [200.0, 100.0]).splitlines() if "1x1 conv" in row)
    jit = 100 * 2 * macs / 1e-3 / 1e9 / 200.0
    ort = 100 * 2 * macs / 1.3e-3 / 1e9 / 200.0
    assert line.split() == ["1x1", "conv", "jitbyoc", f"{jit:.1f}", f"{jit:.1f}", "median", f"{jit:.1f}",
                            "onnxruntime", f"{ort:.1f}", f"{ort:.1f}", "median", f"{ort:.1f}"]
