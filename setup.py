"""Maps the top-level code folders onto one import namespace, ``nibble.*``.

``kernels/`` installs as ``nibble.kernels`` and so on; subpackages are
discovered automatically, so a new folder with an ``__init__.py`` ships without
editing this file. ``nibble`` itself is an implicit namespace package.
"""

from setuptools import find_packages, setup

CODE_FOLDERS = ("kernels", "tiering", "services", "proto", "bench")

package_dir = {}
packages = []
for folder in CODE_FOLDERS:
    root = f"nibble.{folder}"
    package_dir[root] = folder
    packages.append(root)
    packages.extend(f"{root}.{sub}" for sub in find_packages(folder))

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"nibble.proto": ["**/*.proto"], "nibble.services": ["**/*.jinja"]},
)
