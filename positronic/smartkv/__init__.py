"""SmartKV: per-layer learned gates decide which KV rows each layer keeps.

- gates.py: one small MLP per layer, pre-RoPE key -> predicted log4(1 + lifespan); safetensors files.
- labels.py: lifespans from the model's own attention (the training labels).
- train.py / __main__.py: `python -m positronic.smartkv train ...`.
- rows.py: the per-layer slot layout (sinks, FIFO window, long-term top-k by score).
- cache.py: SmartKVCache, a transformers Cache usable in `model.generate`.
- policy.py: `--policy smartkv`, the same inside the brain's tick (registered in positronic.policies).

See docs/smartkv.md.
"""

from .cache import SmartKVCache, SmartKVLayer
from .gates import Gate, GateFileError, GateSet
from .policy import SmartKVPolicy  # registers policy smartkv

__all__ = ["Gate", "GateFileError", "GateSet", "SmartKVCache", "SmartKVPolicy", "SmartKVLayer"]
