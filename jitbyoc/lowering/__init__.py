"""Renderers of the kernel IR: ``llvm`` (llvmlite IR, JIT-compiled) and ``c`` (C source)."""
