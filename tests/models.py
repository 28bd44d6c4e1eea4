"""TVMScript models shared by the tests (TVMScript must live in a real source file)."""

import tvm
from tvm.script import relax as R


@tvm.script.ir_module
class SeedExample:
    """The seeds' BYOC example: add -> subtract -> multiply on four 10x10 inputs."""

    @R.function
    def main(a: R.Tensor((10, 10), "float32"), b: R.Tensor((10, 10), "float32"),
             c: R.Tensor((10, 10), "float32"), d: R.Tensor((10, 10), "float32")):
        with R.dataflow():
            x = R.add(a, b)
            y = R.subtract(x, c)
            z = R.multiply(y, d)
            R.output(z)
        return z


@tvm.script.ir_module
class WithUnsupported:
    """Elementwise ops around an op jitbyoc leaves to TVM (sort has no jitbyoc rule)."""

    @R.function
    def main(a: R.Tensor((4, 16), "float32"), b: R.Tensor((16,), "float32")):
        with R.dataflow():
            x = R.add(a, b)
            y = R.sort(x, axis=1)
            z = R.multiply(y, R.const(3.0, "float32"))
            w = R.nn.relu(z)
            R.output(w)
        return w


@tvm.script.ir_module
class Branchy:
    """Regions inside both branches of an If."""

    @R.function
    def main(c: R.Tensor((), "bool"), a: R.Tensor((4, 8), "float32"), b: R.Tensor((8,), "float32")):
        if c:
            with R.dataflow():
                x = R.add(a, b)
                y = R.nn.relu(x)
                R.output(y)
            r = y
        else:
            with R.dataflow():
                z = R.multiply(a, b)
                R.output(z)
            r = z
        return r


@tvm.script.ir_module
class Symbolic:
    """A symbolic batch dimension, broadcast against a row."""

    @R.function
    def main(a: R.Tensor(("n", 8), "float32"), b: R.Tensor((1, 8), "float32")):
        with R.dataflow():
            x = R.add(a, b)
            y = R.tanh(x)
            z = R.multiply(y, a)
            R.output(z)
        return z


@tvm.script.ir_module
class HalfPrecision:
    """float16 arithmetic: jitbyoc computes it in float32 and rounds the result."""

    @R.function
    def main(a: R.Tensor((8,), "float16"), b: R.Tensor((8,), "float16")):
        with R.dataflow():
            x = R.add(a, b)
            R.output(x)
        return x


@tvm.script.ir_module
class AddReluSmall:
    """Same op names as AddReluLarge, different shape and constant."""

    @R.function
    def main(a: R.Tensor((3, 5), "float32")):
        with R.dataflow():
            x = R.add(a, R.const(1.0, "float32"))
            y = R.nn.relu(x)
            R.output(y)
        return y


@tvm.script.ir_module
class AddReluLarge:
    @R.function
    def main(a: R.Tensor((7, 9), "float32")):
        with R.dataflow():
            x = R.add(a, R.const(-2.5, "float32"))
            y = R.nn.relu(x)
            R.output(y)
        return y


@tvm.script.ir_module
class AddReluSmallOtherConst:
    """Same region content as AddReluSmall (so the same symbol), another constant."""

    @R.function
    def main(a: R.Tensor((3, 5), "float32")):
        with R.dataflow():
            x = R.add(a, R.const(4.0, "float32"))
            y = R.nn.relu(x)
            R.output(y)
        return y


@tvm.script.ir_module
class TwinRegions:
    """Two regions with the same content on either side of an op left to TVM."""

    @R.function
    def main(a: R.Tensor((4, 16), "float32"), b: R.Tensor((4, 16), "float32")):
        with R.dataflow():
            x = R.nn.relu(R.add(a, b))
            y = R.sort(x, axis=1)
            z = R.nn.relu(R.add(y, b))
            R.output(z)
        return z
