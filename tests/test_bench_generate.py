"""``python -m bench.decoders --generate`` on its tiny configuration: the decode step with a
KV cache, exported with symbolic new and past lengths and built once by jitbyoc, generates
torch eager's greedy tokens, with logits within rtol 1e-4, atol 1e-5 of torch's at every
step (prefill at past 0 included), and the bench's printout says so."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import generate as gen  # noqa: E402
from bench import generate_measure  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model = gen.make_model("tiny")
    step = gen.decode_step(model)
    return model, step, gen.import_step(step, model)


def test_greedy_generation_matches_torch_eager(tiny):
    model, step, mod = tiny
    _ex, run, _seconds, offloaded = gen.build(mod)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 31), dtype=np.int64)
    ours = gen.generate(gen.jit_runner(run), model, prompt, 6)
    theirs = gen.generate(gen.torch_runner(step), model, prompt, 6)
    assert ours.tokens == theirs.tokens
    assert len(ours.step_s) == 5 and len(ours.logits) == 6
    for i, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"step {i}")
    done, total = map(int, offloaded.split()[0].split("/"))
    assert done >= total - 2, offloaded


def test_positions_follow_the_cache(tiny):
    """Prefill then one decode step gives the logits of the whole sequence run at once."""
    model, step, _mod = tiny
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits[:, -1]
        first = step(ids[:, :8], *[torch.from_numpy(a) for a in gen.empty_cache(model)])
        last = step(ids[:, 8:], *first[1:])
    np.testing.assert_allclose(last[0].numpy(), whole.numpy(), rtol=1e-4, atol=1e-5)


def test_weight_bytes():
    model = gen.make_model("tiny")  # tied: the lm_head reads the table whole
    fp32 = gen.weight_bytes(model, "fp32", 32)
    assert fp32 == 4 * sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    row = 4 * model.config.hidden_size  # the lookup's row of the tied table, float32
    assert gen.weight_bytes(model, "bf16", 32) == fp32 - 2 * linear + row
    assert gen.weight_bytes(model, "int8", 32) == fp32 - 4 * linear + linear + linear // 16 + row
    assert gen.weight_bytes(model, "int4", 128) == fp32 - 4 * linear + linear // 2 + linear // 64 + row


def args(**kw):
    base = dict(weights="fp32", group_size=32, prompt=31, tokens=3, repeat=1, past=None, top=3, threads=2)
    return argparse.Namespace(**{**base, **kw})


def test_the_bench_prints_generation_against_torch_and_fp32(tiny, capsys):
    generate_measure.measure_generation(args(weights="bf16"), *tiny)
    out = capsys.readouterr().out
    assert "greedy tokens equal to torch's: 3 of 3" in out
    assert "against jitbyoc's fp32 build" in out and "equal 3 of 3" in out
    for what in ("prefill 31 tokens, ms", "decode, ms/token", "decode, tokens/s", "memory bound"):
        assert what in out


def test_the_bench_prints_past_lengths_and_profiles(tiny, capsys):
    generate_measure.measure_past(args(past=[4, 40], repeat=2, top=50), *tiny)
    out = capsys.readouterr().out
    assert "jitbyoc.profile at past 4:" in out and "jitbyoc.profile at past 40:" in out
    # the regions that concatenate the cache are marked: per layer, the value projection's
    # and attention's (the keys')
    marked = [line for line in out.splitlines() if " cache " in line and "concat" in line]
    assert len(marked) >= 2 and "past-length tensor ('cache'): " in out


def test_the_read_bandwidth_loop_loads_every_element_once():
    """The memory bound's yardstick (:func:`bench.decoders.read_bandwidth`) sums its
    buffer: the compiled loop's sum equals numpy's, so it reads each element once (a loop
    that skipped or repeated vectors would measure another number of bytes)."""
    import ctypes

    from bench.decoders import READ_ACCUMULATORS, _read_ir
    from jitbyoc.peak import jit_loop, lanes

    loop, _engine = jit_loop(_read_ir(lanes()), "read", (ctypes.c_int64, ctypes.c_void_p))
    groups = 37
    buf = np.arange(groups * READ_ACCUMULATORS * lanes(), dtype="float32") % 7
    lane_sums = buf.reshape(-1, lanes()).sum(axis=0)
    assert loop(groups, buf.ctypes.data) == lane_sums[0]


def test_reads_cache():
    assert generate_measure.reads_cache("1x1x64, 1x2x2000x16 -> 1x2x2001x16", 2000)
    assert not generate_measure.reads_cache("1x1x64, 64x64 -> 1x1x64", 2000)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_bench_runs_quantized_weights(tiny, capsys, weights):
    import jitbyoc

    if not hasattr(jitbyoc, "quantize_weights"):
        pytest.skip("jitbyoc.quantize_weights is not there yet")
    generate_measure.measure_generation(args(weights=weights, tokens=2), *tiny)
    out = capsys.readouterr().out
    assert "against jitbyoc's fp32 build" in out and "memory bound" in out
