"""The KV cache: `SpliceCache` (cache.py) and one module per layer type (splice, ring, packed,
int4h), with the 4-bit codecs (formats.py), key centres, RoPE helpers and the Triton kernel
beside them."""

from .cache import (DEFAULT_CAPACITY, STORES, Int4HLayer, OneSequenceLayer, PackedSpliceLayer, RingLayer, RingPlan,
                    RowPositions, Scratch, SpliceCache, SpliceLayer, check_store)

__all__ = ["DEFAULT_CAPACITY", "STORES", "Int4HLayer", "OneSequenceLayer", "PackedSpliceLayer", "RingLayer",
           "RingPlan", "RowPositions", "Scratch", "SpliceCache", "SpliceLayer", "check_store"]
