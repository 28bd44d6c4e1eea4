"""The bench's peers (``bench/peers.py``): each runs with its own defaults, the thread
count aside."""

from __future__ import annotations

import pytest

SPIN_KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")
PLAIN_OPTIONS = ("enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse",
                 "execution_mode", "graph_optimization_level", "inter_op_num_threads",
                 "use_deterministic_compute", "use_per_session_threads")


def test_onnxruntime_runs_at_its_defaults_but_the_thread_count():
    ort = pytest.importorskip("onnxruntime")
    from bench.peers import session_options

    opts, default = session_options(3), ort.SessionOptions()
    assert opts.intra_op_num_threads == 3 and session_options(None).intra_op_num_threads == 0
    for name in PLAIN_OPTIONS:
        assert getattr(opts, name) == getattr(default, name), name
    for key in SPIN_KEYS:  # no config entry set: onnxruntime's own spin policy
        with pytest.raises(Exception, match="does not have configuration"):
            opts.get_session_config_entry(key)
