"""Text -> code -> TVM: the region artifact (:mod:`.region`), the build driver
(:mod:`.driver`: cache, worker pool, engines, module memo), LLVM (:mod:`.jit`,
:mod:`.compile_pool`, :mod:`.compile_worker`), the compile cache (:mod:`.cache`), the
build log (:mod:`.buildlog`) and the runtime module TVM loads (:mod:`.runtime`).
"""
