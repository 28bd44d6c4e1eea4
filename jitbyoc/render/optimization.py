"""How a rendered module is optimized and compiled: a fact of the rendering, returned
with it (a region's :attr:`~jitbyoc.render.llvm.Facts.needs_loop_vectorizer`, each engine
kind's :attr:`~jitbyoc.engines.registry.Engine.pipeline`). The build step only carries it
to LLVM (:mod:`jitbyoc.toolchain.compile_worker` takes it as a plain tuple)."""

from __future__ import annotations

from typing import NamedTuple


class Pipeline(NamedTuple):
    speed_level: int = 2  # the O-level of LLVM's default pipeline (1-3); 0: lean passes only
    vectorize: bool = True  # the loop and SLP vectorizers
    lsr: bool = True  # the backend's loop strength reduction


# Regions: argument checks, engine calls, fused loop nests and epilogues. Scalar loops
# need the loop vectorizer (the encoder block ran 2.2x slower without it); O1 and no
# strength reduction halve their compile time and changed no model's run time.
GLUE = Pipeline(speed_level=1, vectorize=True, lsr=False)
# Regions whose loops are all explicit vectors (Facts.needs_loop_vectorizer False).
GLUE_VECTORS = GLUE._replace(vectorize=False)


def for_region(needs_loop_vectorizer: bool) -> Pipeline:
    return GLUE if needs_loop_vectorizer else GLUE_VECTORS
