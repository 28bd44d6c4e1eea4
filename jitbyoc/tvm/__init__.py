"""Where jitbyoc meets TVM's Relax: the ``tvm.compile`` hook (:mod:`.hook`), patterns
(:mod:`.patterns`), partitioning (:mod:`.partition`, :mod:`.merge`), the codegen TVM calls
(:mod:`.codegen`) and the offload report (:mod:`.report`).
"""
