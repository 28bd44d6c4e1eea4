"""Attention, layout, reduction, norm and resize kernels: ``python -m bench.kernels_misc [--threads N] [--repeat N]``.

Prints, per case, jitbyoc's median time and effective bandwidth (bytes read + written
once, per second) with same-process median-of-repeats ratios against TVM's default build,
numpy and torch eager (if installed); >1 means jitbyoc is faster. jitbyoc, TVM and numpy
take turns in blocks of warm calls (``timing.time_blocks``: a pool that spins after a
call, numpy's OpenBLAS in the attention reference, must not slow the next candidate's
call). torch is timed in a subprocess of its own that never
loads TVM: in a process where TVM's thread pool has run, torch's OpenMP workers only got
a core at scheduler ticks (every small call took 4-16 ms).
Every case is first checked against TVM's result (max|err| column).

Nothing heavy is imported at module level: ``--threads`` must reach TVM_NUM_THREADS
before TVM starts its pool.
"""

from __future__ import annotations

import argparse
import os
import statistics

from .kernel_common import module, vm_function
from .timing import time_alternating, time_blocks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels_misc", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every candidate")
    p.add_argument("--repeat", type=int, default=20, help="timed rounds (median reported)")
    p.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)  # the subprocess
    return p.parse_args(argv)


class _Relax:
    """``tvm.relax``, imported on first use (the torch subprocess never loads TVM)."""

    def __getattr__(self, name):
        from tvm import relax

        return getattr(relax, name)


def cases(rng):
    """(name, input arrays, relax body, numpy fn, torch fn factory) per case."""
    import numpy as np

    relax = _Relax()
    f32 = lambda *s: rng.standard_normal(s).astype("float32")  # noqa: E731
    ln_x, ln_g, ln_b = f32(128, 768), f32(768), f32(768)
    big = f32(4096, 4096)
    bn = [f32(1, 64, 56, 56)] + [f32(64) for _ in range(3)] + [np.abs(f32(64)) + 0.5]
    table, ids = f32(30522, 768), rng.integers(0, 30522, (1, 128)).astype("int64")

    def np_ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

    def np_softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def torch_of(fn):
        return lambda *ts: lambda: fn(*ts)

    def ln_body(bb, x, g, b):
        return bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1]))

    def ln_gelu_body(bb, x, g, b):
        return bb.emit(relax.op.nn.gelu(relax.op.nn.layer_norm(x, g, b, axes=[-1])))

    def bn_body(bb, x, *p):
        y = bb.emit(relax.op.nn.batch_norm(x, *p, axis=1, training=False))
        return bb.emit(relax.op.nn.relu(relax.TupleGetItem(y, 0)))

    def np_bn(x, g, b, m, v):
        s = lambda a: a.reshape(1, -1, 1, 1)  # noqa: E731
        return np.maximum((x - s(m)) / np.sqrt(s(v) + 1e-5) * s(g) + s(b), 0)

    up = f32(1, 64, 56, 56)

    def resize_body(method, mode, rounding):  # a U-Net's or an FPN's 2x upsampling
        return lambda bb, x: bb.emit(relax.op.image.resize2d(x, (112, 112), method=method,
                                                             coordinate_transformation_mode=mode,
                                                             rounding_method=rounding))

    q, k, v = (f32(1, 8, 256, 64) for _ in range(3))
    causal = np.triu(np.full((256, 256), -np.inf, "float32"), 1)[None, None]

    def attention_body(bb, q, k, v, mask):  # as the frontends write it: the fused kernel
        s = relax.op.add(relax.op.multiply(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])),
                                           relax.const(0.125, "float32")), mask)
        return bb.emit(relax.op.matmul(relax.op.nn.softmax(s, axis=-1), v))

    def np_attention(q, k, v, mask):
        return np_softmax(q @ k.transpose(0, 1, 3, 2) * 0.125 + mask) @ v

    return [
        ("attention 8x256x64, causal (fused)", [q, k, v, causal], attention_body, np_attention,
         torch_of(lambda q, k, v, m: F().scaled_dot_product_attention(q, k, v, attn_mask=m))),
        ("layer_norm 128x768", [ln_x, ln_g, ln_b], ln_body, np_ln,
         torch_of(lambda x, g, b: F().layer_norm(x, (768,), g, b))),
        ("layer_norm 128x768 + gelu", [ln_x, ln_g, ln_b], ln_gelu_body,
         None, torch_of(lambda x, g, b: F().gelu(F().layer_norm(x, (768,), g, b)))),
        ("softmax 12x128x128", [f32(12, 128, 128)], lambda bb, x: bb.emit(relax.op.nn.softmax(x)),
         np_softmax, torch_of(lambda x: F().softmax(x, -1))),
        ("transpose 1024x1024", [f32(1024, 1024)],
         lambda bb, x: bb.emit(relax.op.permute_dims(x, [1, 0])), lambda x: np.ascontiguousarray(x.T),
         torch_of(lambda x: x.t().contiguous())),
        ("heads 1x128x12x64 -> 1x12x128x64", [f32(1, 128, 12, 64)],
         lambda bb, x: bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3])),
         lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3)),
         torch_of(lambda x: x.permute(0, 2, 1, 3).contiguous())),
        ("sum last axis 4096x4096", [big], lambda bb, x: bb.emit(relax.op.sum(x, axis=[-1])),
         lambda x: x.sum(-1), torch_of(lambda x: x.sum(-1))),
        ("sum axis 0 4096x4096", [big], lambda bb, x: bb.emit(relax.op.sum(x, axis=[0])),
         lambda x: x.sum(0), torch_of(lambda x: x.sum(0))),
        ("max last axis 4096x4096", [big], lambda bb, x: bb.emit(relax.op.max(x, axis=[-1])),
         lambda x: x.max(-1), torch_of(lambda x: x.amax(-1))),
        ("batch_norm+relu 1x64x56x56", bn, bn_body, np_bn,
         torch_of(lambda x, g, b, m, v: F().relu(F().batch_norm(x, m, v, g, b, False, 0.1, 1e-5)))),
        ("resize2d 1x64x56x56 -> 112x112, linear", [up], resize_body("linear", "half_pixel", ""), None,
         torch_of(lambda x: F().interpolate(x, scale_factor=2, mode="bilinear", align_corners=False))),
        ("resize2d 1x64x56x56 -> 112x112, nearest", [up], resize_body("nearest_neighbor", "asymmetric", "floor"),
         None, torch_of(lambda x: F().interpolate(x, scale_factor=2, mode="nearest"))),
        ("take 128 rows of 30522x768", [table, ids],
         lambda bb, t, i: bb.emit(relax.op.take(t, i, axis=0)), lambda t, i: np.take(t, i, axis=0),
         torch_of(lambda t, i: F().embedding(i, t))),
    ]


def F():  # noqa: N802
    """torch.nn.functional, imported only when a torch peer actually runs."""
    import torch.nn.functional

    return torch.nn.functional


def torch_medians(args) -> list:
    """torch's median seconds per case, measured in a subprocess that never loads TVM;
    Nones without torch."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "bench.kernels_misc", "--torch-only", "--threads",
           str(args.threads), "--repeat", str(args.repeat)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"torch peer failed: {done.stderr.strip().splitlines()[-1:]}")
        return [None] * len(cases(__import__("numpy").random.default_rng(0)))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _torch_only(args) -> None:
    """The subprocess: print torch's median seconds per case as one JSON line."""
    import json

    import numpy as np

    try:
        import torch
    except ImportError:
        print(json.dumps([None] * len(cases(np.random.default_rng(0)))))
        return
    torch.set_num_threads(args.threads)
    out = []
    for _, arrays, _, _, torch_fn in cases(np.random.default_rng(0)):
        with torch.inference_mode():
            t = time_alternating({"torch": torch_fn(*[torch.from_numpy(a) for a in arrays])}, args.repeat)
        out.append(statistics.median(t["torch"]))
    print(json.dumps(out))


def run_case(case, repeat: int, torch_s: float | None = None) -> dict:
    import numpy as np

    name, arrays, body, np_fn, _ = case
    mod = module(arrays, body)
    jit, tvm_default = (vm_function(mod, off, arrays) for off in (True, False))
    out = jit().numpy()
    err = float(np.abs(out - tvm_default().numpy()).max())
    fns = {"jitbyoc": jit, "tvm": tvm_default}
    if np_fn is not None:
        fns["numpy"] = lambda: np_fn(*arrays)
    t = time_blocks(fns, repeat)
    med = {k: statistics.median(v) for k, v in t.items()}
    if torch_s is not None:
        med["torch"] = torch_s
    moved = sum(a.nbytes for a in arrays) + out.nbytes
    if name.startswith("take"):  # only the selected rows are read
        moved = 2 * out.nbytes + arrays[1].nbytes
    row = dict(name=name, ms=med["jitbyoc"] * 1e3, gbs=moved / med["jitbyoc"] / 1e9, err=err)
    row.update({f"vs_{k}": med[k] / med["jitbyoc"] for k in med if k != "jitbyoc"})
    return row


def _print(row: dict) -> None:
    peers = "  ".join(f"x{row[f'vs_{k}']:6.2f} vs {k}" if f"vs_{k}" in row else f"{'n/a':>7s} vs {k}"
                      for k in ("tvm", "numpy", "torch"))
    print(f"{row['name']:36s} {row['ms']:8.3f} ms {row['gbs']:6.1f} GB/s  {peers}  "
          f"max|err| {row['err']:.1e}", flush=True)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.torch_only:
        _torch_only(args)
        return []
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np

    torch_s = torch_medians(args)
    todo = cases(np.random.default_rng(0))
    print(f"threads={args.threads} repeat={args.repeat} load={os.getloadavg()[0]:.1f} "
          "(ratios: median of the other / median of jitbyoc; >1 means jitbyoc is faster)")
    rows = []
    for case, ts in zip(todo, torch_s):
        rows.append(run_case(case, args.repeat, ts))
        _print(rows[-1])
    return rows


if __name__ == "__main__":
    main()
