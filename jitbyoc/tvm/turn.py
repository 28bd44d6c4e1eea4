"""TVM's turn: the one lock around the parts of a build that run TVM's own passes.

TVM's Relax passes are not thread-safe: ``relax.BlockBuilder`` keeps a class-level stack
and ``LegalizeOps`` enters a process-wide TE tag scope, so two threads in them at once
fail ("nested op_tag is not allowed for now"). Every build through jitbyoc's wrapped
pipelines, offloading or not, runs TVM's passes in :data:`TVM_TURN`: partitioning's
rewrites, pattern matching and region merging, ``RunCodegen``, and TVM's own pipeline.
jitbyoc's own work in between (lowering regions, rendering, compiling) runs outside it,
so builds in several threads overlap there; running built VMs never takes it.
"""

from __future__ import annotations

import threading

TVM_TURN = threading.RLock()  # reentrant: partitioning inside a hooked build takes it again
