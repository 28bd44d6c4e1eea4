"""Random elementwise DAGs of float32 ops drawn from the op table, on random broadcastable
shapes of rank 0-4: jitbyoc's build must agree with TVM's default build, exactly when
the graph holds only exact ops.

Values stay finite by construction: every float value carries a bound on its magnitude
(found by evaluating the row's numpy reference over the operands' ranges), ops that
would leave [-1e6, 1e6] are not drawn, and operands outside an op's domain are first
made positive (``abs(x) + 0.5``). So there is no NaN or infinity, where TVM and jitbyoc
legitimately differ (see test_ops: not_equal, limits at +-inf).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tvm import relax

from jitbyoc.ir.ops import OPS
from tests.conftest import RELAX_ROWS, build_both, build_model, relax_call

F32 = "float32"
LIMIT = 1e6
POSITIVE_DOMAIN = {"log": (0,), "sqrt": (0,), "rsqrt": (0,), "power": (0,), "divide": (1,), "mod": (1,),
                   "floor_mod": (1,)}  # a divisor's grid on [-b, b] may step over 0 (1e-16 from it)
ATTRS = {"clip": {"lo": -2.0, "hi": 3.0}, "leakyrelu": {"alpha": 0.1}}
# the smallest |x| where an op's value is unbounded: a grid over [-b, b] can step over it
# (tan on [-10, 10] read at most 14 there; tan(1.5707) is 10,000 and cosh of it infinite)
POLES = {"tan": np.pi / 2}
# float32 rows by signature; a new row joins the graphs by its arity and result dtype
FLOAT_ROWS = [n for n in RELAX_ROWS if F32 in OPS[n].dtypes and OPS[n].out is None
              and n not in ("astype", "where")]
COMPARISONS = [n for n in RELAX_ROWS if F32 in OPS[n].dtypes and OPS[n].out == "bool"]
LOGIC = [n for n in RELAX_ROWS if OPS[n].dtypes == {"bool"}]
KINDS = FLOAT_ROWS + COMPARISONS + LOGIC + ["where", "astype"]


def output_bound(name: str, bounds: list[float], attrs: dict) -> float:
    """max |op(x...)| over operands in [-b, b] (or [0.5, b + 0.5] where the op needs
    positive ones), from the row's numpy reference on a grid; inf when not finite or when
    an operand's range reaches a pole (:data:`POLES`)."""
    if name in POLES and max(bounds) >= POLES[name]:
        return np.inf
    axes = []
    for k, b in enumerate(bounds):
        positive = k in POSITIVE_DOMAIN.get(name, ())
        axes.append(np.linspace(0.5, b + 0.5, 41) if positive else np.linspace(-b, b, 41))
    grids = np.meshgrid(*axes, indexing="ij")
    with np.errstate(all="ignore"):
        out = OPS[name].ref(*(g.ravel() for g in grids), **attrs)
    return float(np.max(np.abs(out))) if np.all(np.isfinite(out)) else np.inf


@st.composite
def graphs(draw):
    rank = draw(st.integers(0, 4))
    full = draw(st.lists(st.sampled_from([1, 2, 3, 5]), min_size=rank, max_size=rank))

    def shape():  # a suffix of the full shape, some dims set to 1
        r = draw(st.integers(0, rank))
        return tuple(d if draw(st.booleans()) else 1 for d in full[rank - r:])

    inputs = [shape() for _ in range(draw(st.integers(1, 3)))]
    steps = [(draw(st.sampled_from(KINDS)), draw(st.lists(st.integers(0, 10 ** 6), min_size=3, max_size=3)))
             for _ in range(draw(st.integers(3, 10)))]
    return inputs, steps, draw(st.integers(0, 2 ** 32 - 1))


class Graph:
    """Emits ops into a BlockBuilder, tracking each value's dtype and magnitude bound."""

    def __init__(self, bb, xs):
        self.n_inputs = len(xs)
        self.bb, self.values, self.names = bb, [], set()
        self.used, self.alive = set(), []  # ids of consumed values; alive keeps ids unique
        for x in xs:
            self.values.append((x, F32, 10.0))  # inputs are |N(0, 3)| clipped to 10

    def emit(self, name, args, attrs=None):
        self.used.update(id(a) for a in args)
        self.names.add(name)
        self.alive += [*args, self.bb.emit(relax_call(name, args, attrs))]
        return self.alive[-1]

    def pick(self, dtype, r):
        pool = [v for v in self.values if v[1] == dtype]
        return pool[r % len(pool)] if pool else None

    def positive(self, v):
        """abs(v) + 0.5, for an operand that must be positive."""
        x, _, b = v
        return self.emit("add", [self.emit("abs", [x]), relax.const(0.5, F32)]), F32, b

    def step(self, kind, rs):
        row = OPS[kind] if kind in OPS else None
        if kind in FLOAT_ROWS:
            ops = [self.pick(F32, r) for r in rs[:row.arity]]
            attrs = ATTRS.get(kind, {})
            bound = output_bound(kind, [b for _, _, b in ops], attrs)
            if bound > LIMIT:
                return
            ops = [self.positive(v) if k in POSITIVE_DOMAIN.get(kind, ()) else v for k, v in enumerate(ops)]
            self.values.append((self.emit(kind, [x for x, _, _ in ops], attrs), F32, max(bound, 1e-30)))
        elif kind in COMPARISONS:
            self.values.append((self.emit(kind, [self.pick(F32, r)[0] for r in rs[:row.arity]]), "bool", 1))
        elif kind in LOGIC and self.pick("bool", 0):
            self.values.append((self.emit(kind, [self.pick("bool", r)[0] for r in rs[:row.arity]]), "bool", 1))
        elif kind == "where" and self.pick("bool", 0):
            (c, _, _), (a, _, ba), (b, _, bb) = self.pick("bool", rs[0]), self.pick(F32, rs[1]), self.pick(F32, rs[2])
            self.values.append((self.emit("where", [c, a, b]), F32, max(ba, bb)))
        elif kind == "astype":
            src = self.pick("bool", rs[0]) if rs[1] % 2 and self.pick("bool", 0) else self.pick(F32, rs[0])
            to = F32 if src[1] == "bool" else "bool"
            self.values.append((self.emit("astype", [src[0]], {"to": to}), to, 1))

    def outputs(self):
        """Every value no op consumed (inputs excluded), as the model's outputs."""
        return [v for v, _, _ in self.values[self.n_inputs:] if id(v) not in self.used]


# cosh(tan(x)) on inputs up to 10: tan's grid bound was finite, so cosh was drawn, and an
# input near pi/2 made it infinite (POLES)
TAN_POLE = ([()], [("abs", [0, 0, 0])] * 6 + [("tan", [0, 0, 0]), ("abs", [0, 0, 0]), ("cosh", [7, 0, 0]),
                                               ("abs", [0, 0, 0])], 64)

# floor_mod(x, sin(x - x)): a divisor of 0 (NaN) that its grid missed; divisors are made positive
ZERO_DIVISOR = ([()], [("subtract", [0, 0, 0]), ("sin", [1, 0, 0]), ("floor_mod", [0, 236, 0])], 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
@example(TAN_POLE)
@example(ZERO_DIVISOR)
def test_random_graph_matches_tvm(graph):
    inputs, steps, seed = graph
    built = {}

    def body(bb, *xs):
        g = Graph(bb, xs)
        for kind, rs in steps:
            g.step(kind, rs)
        built["graph"] = g
        outs = g.outputs()
        return outs or [g.emit("negative", [xs[0]])]

    mod = build_model({f"x{i}": (s, F32) for i, s in enumerate(inputs)}, body)
    g = built["graph"]
    builds = build_both(mod)
    n_ops = sum(1 for b in mod["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call))
    assert builds.report.offloaded_ops == n_ops, str(builds.report)
    rng = np.random.default_rng(seed)
    arrays = [np.clip(rng.standard_normal(s) * 3, -10, 10).astype(F32) for s in inputs]
    tvm_outs, jit_outs = builds.run(*arrays)
    if not isinstance(tvm_outs, list):
        tvm_outs, jit_outs = [tvm_outs], [jit_outs]
    exact = all(OPS[n].ulp == 0 for n in g.names)
    scale = max(1.0, max(b for _, dt, b in g.values if dt == F32))
    for k, (want, got) in enumerate(zip(tvm_outs, jit_outs)):
        what = f"output {k} of {sorted(g.names)}:\n{mod}"
        assert got.dtype == want.dtype and got.shape == want.shape, what
        assert np.all(np.isfinite(got)) if got.dtype.kind == "f" else True, what
        if exact or got.dtype == bool:
            np.testing.assert_array_equal(got, want, err_msg=what)
        else:  # errors of the approximate ops, compounded: relative, or absolute at the graph's scale
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=what)
