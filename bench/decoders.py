"""``python -m bench.decoders``: decoder LLMs built once with a symbolic sequence length.

GPT-2, Llama and Qwen2 from ``transformers`` (random weights, ``use_cache=False``),
exported with ``torch.export.Dim`` for the sequence and imported with
``from_exported_program``. TVM's default build cannot build them (see
``tests/test_decoders.py``); jitbyoc builds each once and runs every length. Per length:
jitbyoc and torch eager, each timed in a warm loop of its own, in turns (their thread
pools spin after a call), medians. At length 1 the run reads every weight once (of the
lookup tables only the rows it looks up: :func:`weights_read`): those bytes over the time
are compared with the machine's read bandwidth on the same threads, measured here
(:func:`read_bandwidth`; numpy's one-thread copy bandwidth is printed beside it). The
small models' weights (35-50 MB) partly fit in the L3 cache (32 MiB per CCD on Zen 4),
so a run can read them faster than memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .run import machine_info
from .timing import Stats, time_alternating

SIZES = {"tiny": {"layers": 2, "hidden": 64, "heads": 4, "kv": 2, "ffn": 128, "vocab": 128},
         "small": {"layers": 4, "hidden": 512, "heads": 8, "kv": 4, "ffn": 1536, "vocab": 8192}}


def make_model(name: str, size: str):
    import torch
    import transformers

    s = SIZES[size]
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=s["layers"], n_head=s["heads"], n_embd=s["hidden"],
                                      vocab_size=s["vocab"], n_positions=1024, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        kind = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[name]
        cfg = kind[0](num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                      hidden_size=s["hidden"], intermediate_size=s["ffn"], vocab_size=s["vocab"],
                      max_position_embeddings=1024)
        model = kind[1](cfg)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model.eval()

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    return Logits().eval(), model


def weights_read(model, length: int) -> int:
    """Bytes of weights one run at ``length`` reads: every parameter once (a tied output
    embedding counted once, read whole by the logits), but of a lookup table (the input
    embedding, GPT-2's positions) only the ``length`` rows it looks up."""
    out = model.get_output_embeddings().weight
    tables = [model.get_input_embeddings().weight]
    if hasattr(model, "transformer"):  # GPT-2's learned positions
        tables.append(model.transformer.wpe.weight)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for t in tables:
        if t is not out:
            total -= (t.shape[0] - min(length, t.shape[0])) * t.shape[1] * t.element_size()
    return total


def build(net):
    import torch
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    import jitbyoc

    seq = torch.export.Dim("seq", min=1, max=512)
    with torch.no_grad():
        program = torch.export.export(net, (torch.zeros((1, 8), dtype=torch.int64),),
                                      dynamic_shapes={"ids": {1: seq}})
    mod = from_exported_program(program, keep_params_as_input=False)
    start = time.perf_counter()
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target="llvm")
        report = jitbyoc.last_report()
    return relax.VirtualMachine(ex, tvm.cpu())["main"], time.perf_counter() - start, report


def copy_bandwidth() -> float:
    """Bytes per second of a large numpy copy (read + write), the median of 5."""
    src = np.ones(32 * 1024 * 1024, "float64")
    dst = np.empty_like(src)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / float(np.median(times[1:]))


READ_ACCUMULATORS = 4  # independent sums, so that the loop waits on memory, not on an add


def _read_ir(width: int) -> str:
    """``float read(int64 n, ptr buf)``: the sum of ``n`` groups of :data:`READ_ACCUMULATORS`
    ``<width x float>`` vectors of ``buf``, every byte loaded once."""
    from llvmlite import ir

    from jitbyoc.peak import summed_loop

    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, width)
    module = ir.Module(name="read")
    fn = ir.Function(module, ir.FunctionType(f32, [i64, ir.PointerType()]), "read")

    def step(b, i, accs):
        base = b.mul(i, i64(READ_ACCUMULATORS * width))
        return [b.fadd(acc, b.load(b.gep(fn.args[1], [b.add(base, i64(k * width))], source_etype=f32),
                                   typ=vec, align=64))
                for k, acc in enumerate(accs)]

    summed_loop(fn, fn.args[0], [ir.Constant(vec, None)] * READ_ACCUMULATORS, step)
    return str(module)


def read_bandwidth(threads: int, mib: int = 512) -> float:
    """Bytes per second that ``threads`` threads read together, each summing its share of a
    ``mib`` MiB buffer (a compiled loop of vector loads: numpy's copy is one thread and
    writes as much as it reads), the best of 6. A decode step only reads its weights: on
    Zen 5 the fp32 step read 53 GB/s where one thread's numpy copy gave 39.5 (read +
    write), so the copy made a bound the step ran at 134 % of."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from jitbyoc.peak import jit_loop, lanes

    width = lanes()
    loop, _engine = jit_loop(_read_ir(width), "read", (ctypes.c_int64, ctypes.c_void_p))
    buf = np.ones(mib << 18, "float32")
    group = READ_ACCUMULATORS * width
    share = buf.size // threads // group * group
    jobs = [(share // group, buf.ctypes.data + t * share * 4) for t in range(threads)]
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(6):
            start = time.perf_counter()
            list(pool.map(lambda job: loop(*job), jobs))
            best = max(best, threads * share * 4 / (time.perf_counter() - start))
    return best


def measure(name: str, size: str, lengths, repeat: int) -> list[dict]:
    import torch
    import tvm

    net, model = make_model(name, size)
    run, build_s, report = build(net)
    rows = []
    for length in lengths:
        ids = np.random.default_rng(length).integers(0, SIZES[size]["vocab"], (1, length), dtype=np.int64)
        arg, tids = tvm.runtime.tensor(ids), torch.from_numpy(ids)

        def ours(arg=arg):
            out = run(arg)
            return out[0] if not hasattr(out, "numpy") else out

        def eager(tids=tids):
            with torch.no_grad():
                return net(tids)

        err = float(np.abs(ours().numpy() - eager().numpy()).max())
        mine = Stats.of(time_alternating({"j": ours}, repeat, 2)["j"])
        theirs = Stats.of(time_alternating({"t": eager}, repeat, 2)["t"])
        rows.append({"model": name, "size": size, "length": length, "jitbyoc_ms": mine.median * 1e3,
                     "torch_ms": theirs.median * 1e3, "speedup": theirs.median / mine.median, "max_err": err,
                     "weights_gbps": weights_read(model, length) / mine.median / 1e9, "build_s": build_s,
                     "offloaded": f"{report.offloaded_ops}/{report.total_ops}"})
    return rows


def machine_line(threads: int) -> str:
    """The CPU line printed with every figure (:func:`bench.run.machine_info`)."""
    info = machine_info(threads)
    return (f"CPU {info['cpu_model']} ({info['cpu']}), {threads} threads, load {info['loadavg']}, "
            f"torch {info['torch']}, tvm {info['tvm']}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--generate" in argv:  # its own options: bench/generate.py
        from .generate import main as generate

        return generate([a for a in argv if a != "--generate"])
    ap = argparse.ArgumentParser(prog="python -m bench.decoders", description=__doc__.splitlines()[0])
    ap.add_argument("--generate", action="store_true",
                    help="greedy generation with a KV cache instead (python -m bench.decoders --generate --help)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--model", action="append", choices=["gpt2", "llama", "qwen2"])
    ap.add_argument("--length", type=int, action="append", help="sequence lengths (default 1, 128)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); copy bandwidth "
          f"{copy_bandwidth() / 1e9:.1f} GB/s (numpy, one thread, read + write)")
    print(f"{'model':6} {'size':5} {'len':>4} {'jitbyoc ms':>10} {'torch ms':>9} {'torch/jit':>9} "
          f"{'weights GB/s':>12} {'of read bw':>10} {'max err':>8} {'build s':>7} offloaded")
    for name in args.model or ["gpt2", "llama", "qwen2"]:
        for r in measure(name, args.size, args.length or [1, 128], args.repeat):
            print(f"{r['model']:6} {r['size']:5} {r['length']:4d} {r['jitbyoc_ms']:10.3f} {r['torch_ms']:9.3f} "
                  f"{r['speedup']:9.2f} {r['weights_gbps']:12.2f} {r['weights_gbps'] * 1e9 / bandwidth:10.0%} "
                  f"{r['max_err']:8.1e} {r['build_s']:7.2f} {r['offloaded']}")


if __name__ == "__main__":
    main()
