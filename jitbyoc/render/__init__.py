"""Kernel IR -> text: LLVM IR through llvmlite (:mod:`.llvm`) and C (:mod:`.c`), with the
same structure (:mod:`.portable` lets a kernel write its body once for both). Rendering
returns what it found out (:class:`.llvm.Facts`); it never compiles anything.
"""
