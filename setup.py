"""Maps the top-level code folders onto one import namespace, ``nibble.*``.

``kernels/`` installs as ``nibble.kernels`` and so on; subpackages are
discovered automatically, so a new folder with an ``__init__.py`` ships without
editing this file. ``nibble`` itself is an implicit namespace package.
``services/client/`` (the SDK) installs as ``nibble.client`` only, not also as
``nibble.services.client``.
"""

from setuptools import find_packages, setup

CODE_FOLDERS = ("kernels", "tiering", "services", "proto", "bench")
RENAMED = {"nibble.client": "services/client"}     # package -> folder, outside its parent's tree

package_dir = {}
packages = []
for root, folder in [*((f"nibble.{f}", f) for f in CODE_FOLDERS), *RENAMED.items()]:
    # a renamed folder nested in this one ships under its own name only
    nested = [r.removeprefix(folder + "/") for r in RENAMED.values() if r.startswith(folder + "/")]
    exclude = [x for n in nested for x in (n.replace("/", "."), n.replace("/", ".") + ".*")]
    package_dir[root] = folder
    packages.append(root)
    packages.extend(f"{root}.{sub}" for sub in find_packages(folder, exclude=exclude))

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"nibble.proto": ["**/*.proto"], "nibble.services": ["**/*.jinja"],
                  "nibble.bench": ["models/*/config.json"],
                  # the CUDA C++ that nibble.kernels.cuda builds on first use
                  "nibble.kernels.cuda": ["csrc/*.cu", "csrc/*.cuh", "csrc/*.cpp"],
                  "nibble.kernels.cpu": ["csrc/*.c"]},
)
