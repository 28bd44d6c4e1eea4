"""The kernel IR and its vocabulary: what every later step reads.

:mod:`.kir` (stages, buffers, expressions; the canonical text code is keyed by),
:mod:`.dtypes` (every dtype fact), :mod:`.ops` (the elementwise op table) with
:mod:`.vecmath` (its transcendental expansions), :mod:`.rules` (the rule registry: one
rule per Relax op), :mod:`.relax_types` (reading Relax types) and :mod:`.errors`.
"""
