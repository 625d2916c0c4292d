"""Package discovery for the wheel and the sdist (everything else is in pyproject.toml).

``model_zoo/`` and ``callbacks/`` live at the top level of the repository but install as
``lightning_fedhet.model_zoo`` and ``lightning_fedhet.callbacks`` (``[tool.setuptools.package-dir]``).
setuptools' ``packages.find`` cannot rename what it finds, so this file runs the same discovery over each
folder and renames the result: a new subpackage anywhere is picked up without editing a list.
"""

from setuptools import find_packages, setup

MAPPED = {"lightning_fedhet.model_zoo": "model_zoo", "lightning_fedhet.callbacks": "callbacks"}

packages = find_packages(include=["lightning_fedhet", "lightning_fedhet.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=sorted(packages))
