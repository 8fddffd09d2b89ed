"""The texts shipped with the package, installed as `positronic.texts` (pyproject.toml maps this
folder there and lists the files as package data; this file makes it a regular package, which
setuptools' editable finder can map and `importlib.resources` can read, installed or not).

DEFAULT_TEXT is a real file path: the package is never installed zipped (a wheel is unpacked,
and the editable install points here), so the Traversable from `files()` is a pathlib.Path.
"""

from importlib.resources import files
from pathlib import Path

DEFAULT_TEXT = Path(files(__name__) / "alice_ch1-2.txt")  # positronic eval's default; see PROVENANCE.md
PROVENANCE = Path(files(__name__) / "PROVENANCE.md")
