"""Package layout (metadata lives in pyproject.toml): ``aot/`` is ``dsa_aot``; ``kernels/``,
``specs/`` and ``cache/`` are its subpackages; every package below them (each backend under
``aot/backends/``) is found here, so adding a backend needs no packaging change."""

from setuptools import find_packages, setup

DIRS = {"dsa_aot": "aot", "dsa_aot.kernels": "kernels", "dsa_aot.specs": "specs", "dsa_aot.cache": "cache"}
packages = []
for name, folder in DIRS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
setup(package_dir=DIRS, packages=packages)
