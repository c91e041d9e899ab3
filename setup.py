"""Package layout (metadata lives in pyproject.toml): ``aot/`` is ``dsa_aot``; ``kernels/``,
``specs/`` and ``cache/`` are its subpackages; every package below them (each backend under
``aot/backends/``) is found here, so adding a backend needs no packaging change.

The build also writes ``dsa_aot/_source_facts.json``: each module's sha256 and the ``dsa_aot``
modules it imports, as :mod:`dsa_aot.specs.sources` derives them. A process computing a runtime
identity then reads a module's imports from it when the installed file has that sha256, instead
of parsing the file (the first process of a fresh container would parse ~20 files)."""

import importlib.util
import json
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

DIRS = {"dsa_aot": "aot", "dsa_aot.kernels": "kernels", "dsa_aot.specs": "specs", "dsa_aot.cache": "cache"}
packages = []
for name, folder in DIRS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


class BuildPyWithSourceFacts(build_py):
    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("_dsa_aot_sources", Path(__file__).parent / "specs" / "sources.py")
        sources = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sources)  # standard library only: nothing of dsa_aot is imported
        root = Path(self.build_lib)
        if not (root / "dsa_aot" / "__init__.py").is_file():  # an editable build copies no sources
            return
        facts = {}
        for path in sorted((root / "dsa_aot").rglob("*.py")):
            name = path.relative_to(root).as_posix()
            module = name[:-len("/__init__.py")] if name.endswith("/__init__.py") else name[:-len(".py")]
            facts[name] = sources.parse_facts(path.read_bytes(), module.replace("/", "."), path.name == "__init__.py",
                                              str(path))
        (root / "dsa_aot" / sources.SHIPPED_FACTS).write_text(json.dumps(facts, sort_keys=True))


setup(package_dir=DIRS, packages=packages, cmdclass={"build_py": BuildPyWithSourceFacts})
