"""The package list; all other metadata and the folder mapping are in pyproject.toml.

steps/, mirror/ and texts/ install as positronic.steps, positronic.mirror and positronic.texts
(`[tool.setuptools.package-dir]`). pyproject.toml can either discover packages or list them, not
both, and discovery cannot find packages whose folder lies outside positronic/; a fixed list
would silently leave out the next subpackage of positronic/ from wheels (the editable install
would still find it, so only an installed copy would break). Hence: discover positronic/ and add
the three mapped packages.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["positronic", "positronic.*"])
      + ["positronic.steps", "positronic.mirror", "positronic.texts"])
