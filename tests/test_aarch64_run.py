"""AArch64 code executed (issue 15): jitbyoc's object from an AArch64 export, linked with a
small C harness that stands in for TVM's runtime (serial parallel-launch, malloc'd
workspaces, errors printed), run under ``qemu-aarch64``, and checked against TVM's build
here. A region's constants (weights packed at build time for NEON) are taken from the
partitioned module. Needs Debian's ``gcc-aarch64-linux-gnu`` and ``qemu-user-static``;
skipped otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile

import numpy as np
import pytest
import tvm
from tvm import relax

import jitbyoc
from tests.conftest import build_model, build_tvm, run
from tests.diff_util import region_constants

CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
pytestmark = pytest.mark.skipif(CC is None or QEMU is None, reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 "
                                "(apt-get install gcc-aarch64-linux-gnu qemu-user-static)")

HARNESS = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct { int32_t type_index; uint32_t pad; union { int64_t v_int64; void* v_ptr; } v; } TVMFFIAny;
typedef struct { void* data; int32_t device_type, device_id, ndim; uint8_t code, bits; uint16_t lanes;
                 int64_t* shape; int64_t* strides; uint64_t byte_offset; } DLTensor;
typedef struct { void* sync_handle; int32_t num_task; } TVMParallelGroupEnv;
void TVMFFIErrorSetRaisedFromCStr(const char* kind, const char* msg) { fprintf(stderr, "%s: %s\n", kind, msg); }
int TVMBackendParallelLaunch(int (*f)(int, TVMParallelGroupEnv*, void*), void* cdata, int n) {
  TVMParallelGroupEnv env = {0, 1}; (void)n; return f(0, &env, cdata); }
void* TVMBackendAllocWorkspace(int t, int d, uint64_t nbytes, int code, int bits) {
  (void)t; (void)d; (void)code; (void)bits; return aligned_alloc(64, (nbytes + 64) / 64 * 64); }
int TVMBackendFreeWorkspace(int t, int d, void* p) { (void)t; (void)d; free(p); return 0; }
int32_t __tvm_ffi_SYMBOL(void*, const TVMFFIAny*, int32_t, TVMFFIAny*);
int main(void) {
  static int64_t shapes[NARGS][6] = {SHAPES};
  static const int ndims[NARGS] = {NDIMS};
  DLTensor t[NARGS]; TVMFFIAny a[NARGS];
  for (int i = 0; i < NARGS; i++) {
    int64_t n = 1; for (int d = 0; d < ndims[i]; d++) n *= shapes[i][d];
    float* data = aligned_alloc(64, (n * 4 + 64) / 64 * 64);
    char name[32]; snprintf(name, sizeof name, "arg%d.bin", i);
    if (i < NINPUTS) { FILE* f = fopen(name, "rb"); if (!f || fread(data, 4, n, f) != (size_t)n) return 2; fclose(f); }
    t[i] = (DLTensor){data, 1, 0, ndims[i], 2, 32, 1, shapes[i], NULL, 0};
    a[i].type_index = 7; a[i].pad = 0; a[i].v.v_ptr = &t[i];
  }
  if (__tvm_ffi_SYMBOL(NULL, a, NARGS, NULL) != 0) return 3;
  for (int i = NINPUTS; i < NARGS; i++) {
    int64_t n = 1; for (int d = 0; d < ndims[i]; d++) n *= shapes[i][d];
    char name[32]; snprintf(name, sizeof name, "arg%d.bin", i);
    FILE* f = fopen(name, "wb"); fwrite(t[i].data, 4, n, f); fclose(f);
  }
  return 0;
}
"""


def _run_under_qemu(obj, symbol: str, inputs, out_shapes, workdir):
    shapes = [a.shape for a in inputs] + list(out_shapes)
    rows = ", ".join("{" + ", ".join(str(d) for d in (list(s) + [1] * 6)[:6]) + "}" for s in shapes)
    source = (HARNESS.replace("SYMBOL", symbol).replace("NARGS", str(len(shapes)))
              .replace("NINPUTS", str(len(inputs))).replace("SHAPES", rows)
              .replace("NDIMS", ", ".join(str(len(s)) for s in shapes)))
    (workdir / "harness.c").write_text(source)
    for i, a in enumerate(inputs):
        np.ascontiguousarray(a, "float32").tofile(workdir / f"arg{i}.bin")
    subprocess.run([CC, "-O1", "-static", "-o", "harness", "harness.c", str(obj), "-lm"], cwd=workdir,
                   check=True, capture_output=True)
    done = subprocess.run([QEMU, "./harness"], check=False, cwd=workdir, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return [np.fromfile(workdir / f"arg{len(inputs) + k}.bin", "float32").reshape(s)
            for k, s in enumerate(out_shapes)]


def _const(*shape):
    """A constant weight, deterministic per shape."""
    rng = np.random.default_rng(sum(shape))
    return relax.const((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype("float32"))


MODELS = {
    "matmul_gelu_softmax": ({"x": ((37, 70), "float32"), "w": ((70, 45), "float32")},
                            lambda bb, x, w: bb.emit(relax.op.nn.softmax(relax.op.nn.gelu(relax.op.matmul(x, w))))),
    "conv_relu": ({"x": ((1, 5, 13, 11), "float32"), "w": ((7, 5, 3, 3), "float32")},
                  lambda bb, x, w: bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))),
    "tanh_add": ({"x": ((3, 101), "float32"), "y": ((101,), "float32")},
                 lambda bb, x, y: bb.emit(relax.op.tanh(relax.op.add(x, y)))),
    # the GEMM engine's pointwise path with a bias epilogue; a strided conv on the pixel
    # engine; the depthwise kernel and a pooling row; norms, softmax and batched products;
    # a reduction over a middle axis
    "pointwise_bias": ({"x": ((1, 48, 15, 15), "float32"), "w": ((96, 48, 1, 1), "float32"),
                        "b": ((1, 96, 1, 1), "float32")},
                       lambda bb, x, w, b: bb.emit(relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(x, w), b)))),
    "conv_stride2": ({"x": ((1, 16, 31, 30), "float32"), "w": ((40, 16, 3, 3), "float32")},
                     lambda bb, x, w: bb.emit(relax.op.nn.conv2d(x, w, strides=2, padding=1))),
    "depthwise_maxpool": ({"x": ((1, 48, 29, 29), "float32"), "w": ((48, 1, 3, 3), "float32")},
                          lambda bb, x, w: bb.emit(relax.op.nn.max_pool2d(
                              relax.op.nn.conv2d(x, w, strides=2, padding=1, groups=48),
                              pool_size=3, strides=2, padding=1))),
    "layer_norm_attention": ({"x": ((2, 37, 64), "float32"), "g": ((64,), "float32"), "b": ((64,), "float32")},
                             lambda bb, x, g, b: bb.emit(relax.op.matmul(relax.op.nn.softmax(relax.op.matmul(
                                 relax.op.nn.layer_norm(x, g, b, axes=[-1]), relax.op.permute_dims(x, [0, 2, 1]))),
                                 x))),
    "mean_of_exp": ({"x": ((3, 67, 19), "float32")},
                    lambda bb, x: bb.emit(relax.op.mean(relax.op.exp(relax.op.multiply(x, x)), axis=[1]))),
    # constant weights, as frontends pass them: packed at build time for NEON's 4 lanes
    # (the pixel engine's blocks of 6 channels, the channel engine's vectors of 4)
    "const_conv_bias": ({"x": ((1, 16, 30, 30), "float32")},
                        lambda bb, x: bb.emit(relax.op.nn.relu(relax.op.add(
                            relax.op.nn.conv2d(x, _const(48, 16, 3, 3), padding=1), _const(1, 48, 1, 1))))),
    "const_conv_small_map": ({"x": ((1, 256, 7, 7), "float32")},
                             lambda bb, x: bb.emit(relax.op.nn.conv2d(x, _const(128, 256, 3, 3), padding=1))),
    "const_linear_gelu": ({"x": ((37, 64), "float32")},
                          lambda bb, x: bb.emit(relax.op.nn.gelu(relax.op.add(
                              relax.op.matmul(x, _const(64, 150)), _const(150))))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_aarch64_code_runs_right_under_qemu(name, tmp_path):
    params, body = MODELS[name]
    mod = build_model(params, body)
    target = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
    with jitbyoc.enabled():
        ex = tvm.compile(mod, target=target)
        (region,) = jitbyoc.last_report().regions
    ex.export_library(str(tmp_path / "model.tar"))
    with tarfile.open(tmp_path / "model.tar") as tf:
        tf.extractall(tmp_path, filter="data")
    # jitbyoc's object: the one naming jitbyoc most (TVM's host module names the region
    # too; regions without a library engine have no jitbyoc_lib_ symbol)
    obj = max((p for p in tmp_path.glob("*.o") if p.name != "devc.o"), key=lambda p: p.read_bytes().count(b"jitbyoc"))
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s).astype("float32") for k, (s, _) in params.items()}
    want = run(build_tvm(mod), *arrays.values())
    arrays.update(region_constants(mod, target))
    order = [text.split(":")[0] for text in region.inputs]  # the region's own argument order
    got = _run_under_qemu(obj, region.symbol, [arrays[k] for k in order], [want.shape], tmp_path)
    # float32 sums of up to 144 products (the conv), in another order and with other
    # roundings (NEON's FMAs) than TVM's build here: absolute error to the output's scale
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=4e-6 * max(1.0, float(np.abs(want).max())))
