"""Text -> code -> TVM: the region artifact (:mod:`.region`), the build driver
(:mod:`.driver`: cache, worker pool, engines, module memo), LLVM (:mod:`.jit`,
:mod:`.compile_pool`, :mod:`.compile_worker`), the compile cache (:mod:`.cache`), the
build session (:mod:`.session`: one build's state, handed from step to step) and the runtime
module TVM loads (:mod:`.runtime`).
"""
