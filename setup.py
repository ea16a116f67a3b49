"""The package list of hfpfl (everything else is in pyproject.toml): every package under hfpfl/ (namespace packages
too, as pyproject's packages.find lists them: the shipped LDM snapshot's folders), and hfpfl.pipelines, which
pyproject.toml's package-dir maps to the top-level pipelines/ folder (setuptools' find cannot list a mapped
package)."""
from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["hfpfl", "hfpfl.*"]) + ["hfpfl.pipelines"])
