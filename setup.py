"""The one packaging setting pyproject.toml cannot state (everything else is there): the inspector's sources stay in
app/ at the top of the repository and install as the package `mmpg_app` beside mmpg's own packages, which are found
as they are added. A package named `app` in site-packages would shadow any other `app` its users import."""

from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["mmpg", "mmpg.*"]) + ["mmpg_app"], package_dir={"mmpg_app": "app"})
