"""``python -m bench.decoders --generate``: greedy generation with a KV cache.

A HuggingFace decoder (random weights, ``torch.manual_seed(0)``) wrapped as one decode
step, ``(input_ids [1, new], k0, v0, k1, v1, ...) -> (logits of the last token [1, vocab],
k0', v0', ...)``, every cache tensor ``[1, kv_heads, past, head_dim]`` in and
``[1, kv_heads, past + new, head_dim]`` out. The step builds a ``DynamicCache`` from the
plain tensors and calls the model with ``use_cache=True`` and ``position_ids = past ..
past + new - 1``. It is exported once with ``torch.export`` and two symbolic sizes,
``new`` (1..512) and ``past`` (0..4096), imported with ``from_exported_program`` and
built once with jitbyoc. ``past`` may be 0: the example input has a past of 5, so export
does not specialize it, and nothing in the step branches on it, so one build runs the
prefill (past 0) and every decode step (new 1).

Generation (:func:`generate`): prefill a prompt (31 tokens), then greedy decoding feeding
the new cache back, N tokens in all (the prefill's and N - 1 decode steps), as HF's
``generate(max_new_tokens=N)``, by jitbyoc and by torch eager running the same step
module. ``--past`` instead times one decode token at each past length and profiles
jitbyoc's step. What is measured and how: :mod:`bench.generate_measure`. Builds are cold:
jitbyoc's disk cache points at an empty temporary directory unless ``--keep-cache``.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .decoders import machine_line, weights_read
from .run import cold_cache

SIZES = {  # Qwen2-0.5B's and TinyLlama-1.1B's published dimensions, and a tiny one for tests
    "tiny": dict(model="qwen2", layers=2, hidden=64, heads=4, kv=2, ffn=128, vocab=128, tied=True,
                 theta=1e6, eps=1e-6),
    "0.5b": dict(model="qwen2", layers=24, hidden=896, heads=14, kv=2, ffn=4864, vocab=151936, tied=True,
                 theta=1e6, eps=1e-6),
    "1.1b": dict(model="llama", layers=22, hidden=2048, heads=32, kv=4, ffn=5632, vocab=32000, tied=False,
                 theta=1e4, eps=1e-5),
}
WEIGHTS = ("fp32", "bf16", "bf16-compute", "int8", "int4")
MAX_NEW, MAX_PAST = 512, 4096


def make_model(size: str):
    """The HF causal LM of ``size``, random weights from ``torch.manual_seed(0)``."""
    import torch
    import transformers

    s = SIZES[size]
    kind = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[s["model"]]
    cfg = kind[0](num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                  hidden_size=s["hidden"], intermediate_size=s["ffn"], vocab_size=s["vocab"],
                  tie_word_embeddings=s["tied"], rope_theta=s["theta"], rms_norm_eps=s["eps"],
                  max_position_embeddings=32768)
    torch.manual_seed(0)
    return kind[1](cfg).eval()


def decode_step(model):
    """``model`` as a decode step on plain tensors (the module docstring)."""
    import torch
    from transformers.cache_utils import DynamicCache

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, *kv):
            cache = DynamicCache(config=self.model.config)
            for i, layer in enumerate(cache.layers):
                layer.lazy_initialization(kv[2 * i], kv[2 * i + 1])
                layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
            past = kv[0].shape[2]
            positions = torch.arange(past, past + ids.shape[1]).unsqueeze(0)
            out = self.model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions)
            kv = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
            return (out.logits[:, -1, :], *kv)

    return Step().eval()


def empty_cache(model, past: int = 0, seed: int | None = None) -> list[np.ndarray]:
    """Keys and values of every layer, ``[1, kv_heads, past, head_dim]``: zeros, or standard
    normal values drawn from ``seed``."""
    c = model.config
    shape = (1, c.num_key_value_heads, past, c.hidden_size // c.num_attention_heads)
    rng = np.random.default_rng(seed)
    return [np.zeros(shape, "float32") if seed is None else rng.standard_normal(shape, dtype="float32")
            for _ in range(2 * c.num_hidden_layers)]


def import_step(step, model):
    """The step exported with symbolic ``new`` and ``past``, imported into Relax."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    new = torch.export.Dim("new", min=1, max=MAX_NEW)
    past = torch.export.Dim("past", min=0, max=MAX_PAST)
    kv = [torch.from_numpy(a) for a in empty_cache(model, 5, seed=0)]
    with torch.no_grad():
        program = torch.export.export(step, (torch.zeros((1, 3), dtype=torch.int64), *kv),
                                      dynamic_shapes={"ids": {1: new}, "kv": tuple({2: past} for _ in kv)})
    return from_exported_program(program, keep_params_as_input=False)


def narrowed(mod, weights: str, group_size: int):
    """``mod`` with its weights stored as ``weights``: the transforms run on the imported
    module before ``tvm.compile``; a new storage plugs in here."""
    import jitbyoc

    if weights == "fp32":
        return mod
    if weights == "bf16-compute":
        return jitbyoc.lower_precision(mod, "bf16")
    return jitbyoc.quantize_weights(mod, bits={"bf16": 16, "int8": 8, "int4": 4}[weights], group_size=group_size)


def build(mod):
    """(executable, its VM's ``main``, build seconds, offload summary) of jitbyoc's build.
    Two scalar int64 ops of the positions stay with TVM: ``arange(past, past + new)``
    (a start that is not a constant) and ``past + new``."""
    import tvm
    from tvm import relax

    import jitbyoc

    start = time.perf_counter()
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
        report = jitbyoc.last_report()
    seconds = time.perf_counter() - start
    left = ", ".join(f.op.removeprefix("relax.") for f in report.fallbacks)
    offloaded = f"{report.offloaded_ops}/{report.total_ops} ops offloaded"
    offloaded += f"; left to TVM: {left}" if left else ""
    return ex, relax.VirtualMachine(ex, tvm.cpu())["main"], seconds, offloaded


def weight_bytes(model, weights: str, group_size: int) -> int:
    """Bytes of weights one decode token reads, with the products' weights stored as ``weights``.

    fp32: :func:`bench.decoders.weights_read` at length 1 (every parameter once as float32;
    of the input embedding one row, unless it is tied to the lm_head, whose product reads
    it whole). Otherwise the weight of every ``Linear`` (the products the transforms of
    :func:`narrowed` rewrite; the lm_head included, a tied table whole) is counted as
    bf16 (stored, or its products' operands): 2 bytes a weight; int8: 1 byte a weight + a
    2-byte scale per group of ``group_size``; int4: half a byte a weight + a 2-byte scale
    per group (float16 scales, as ``jitbyoc.quantize_weights`` stores them where they are
    normal float16 numbers, as they are in these models). Everything else (biases, norm weights) as
    stored, float32; and the input embedding's one looked-up row, tied or not, as float32
    (``lower_precision`` leaves the table float32; ``quantize_weights`` stores it narrow,
    but one row is a few KB either way).
    """
    import torch

    total = weights_read(model, 1)
    if weights == "fp32":
        return total
    from jitbyoc.tvm.weights import SCALE_DTYPE

    scale = np.dtype(SCALE_DTYPE).itemsize / group_size  # a scale a group
    per = {"bf16": 2.0, "bf16-compute": 2.0, "int8": 1.0 + scale, "int4": 0.5 + scale}[weights]
    linear = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for w in linear.values():
        total += int(w.numel() * per) - w.numel() * w.element_size()
    table = model.get_input_embeddings().weight
    if id(table) in linear:  # tied: the lookup's row, still float32
        total += table.shape[1] * table.element_size()
    return total


def jit_runner(run):
    """A step on numpy ids and jitbyoc's cache (tvm tensors, fed back as they came)."""
    import tvm

    def step(ids, cache):
        out = run(tvm.runtime.tensor(ids), *cache)
        return out[0].numpy()[0], [out[i] for i in range(1, len(out))]

    return step, lambda arrays: [tvm.runtime.tensor(a) for a in arrays]


def torch_runner(module):
    """A step on numpy ids and torch eager's cache (torch tensors)."""
    import torch

    def step(ids, cache):
        with torch.no_grad():
            out = module(torch.from_numpy(ids), *cache)
        return out[0].numpy()[0], list(out[1:])

    return step, lambda arrays: [torch.from_numpy(a) for a in arrays]


@dataclass
class Generation:
    tokens: list[int]
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # each decode step's, argmax included
    logits: list[np.ndarray] = field(default_factory=list)  # of every step, the prefill's first


def generate(runner, model, prompt: np.ndarray, n: int, forced: list[int] | None = None) -> Generation:
    """Greedy generation of ``n`` tokens after ``prompt`` ([1, length] int64). ``forced``:
    feed these tokens instead of the step's own choices (the logits and the choices
    recorded are still the step's)."""
    step, cache_of = runner
    cache = cache_of(empty_cache(model))
    ids, out = prompt, None
    for i in range(n):
        start = time.perf_counter()
        logits, cache = step(ids, cache)
        token = int(np.argmax(logits))
        seconds = time.perf_counter() - start
        if out is None:
            out = Generation([], seconds)
        else:
            out.step_s.append(seconds)
        out.tokens.append(token)
        out.logits.append(logits)
        ids = np.array([[token if forced is None else forced[i]]], dtype=np.int64)
    return out


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def describe(size: str, model) -> str:
    s = SIZES[size]
    params = sum(p.numel() for p in model.parameters())
    return (f"{s['model']} {size}: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, "
            f"{s['kv']} kv heads, ffn {s['ffn']}, vocab {s['vocab']}{', tied' if s['tied'] else ''}; "
            f"{params / 1e6:.1f} M parameters")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.decoders --generate",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="0.5b")
    ap.add_argument("--weights", choices=WEIGHTS, default="fp32",
                    help="bf16/int8/int4: weights stored so by jitbyoc.quantize_weights (float32 activations); "
                         "bf16-compute: jitbyoc.lower_precision (bf16 products)")
    ap.add_argument("--group-size", type=int, default=32, help="int8/int4: weights per scale")
    ap.add_argument("--prompt", type=int, default=31, help="prompt tokens (prefilled at past 0)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens generated (the prefill's first)")
    ap.add_argument("--repeat", type=int, default=3, help="generations each (--past: timed tokens each)")
    ap.add_argument("--past", type=int, action="append",
                    help="instead of generating, time a decode token at these past lengths (32, 512, 2000)")
    ap.add_argument("--top", type=int, default=8, help="--past: profile rows printed")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep-cache", action="store_true", help="build with jitbyoc's own disk cache")
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    model = make_model(args.size)
    step = decode_step(model)
    print(describe(args.size, model))
    start = time.perf_counter()
    mod = import_step(step, model)
    print(f"export + import {time.perf_counter() - start:.1f} s "
          f"(symbolic new tokens 1..{MAX_NEW}, past 0..{MAX_PAST})")
    from .generate_measure import measure_generation, measure_past

    with cold_cache(args.keep_cache):
        (measure_past if args.past else measure_generation)(args, model, step, mod)
    print(machine_line(args.threads))  # the load at the end
