"""Installs the card's top-level folders as subpackages of the one import package `inkwell`.

Bare names such as `kernels` or `adapters` collide with real distributions in our dependency
tree, so `sdk/` installs as `inkwell.sdk`, `service/` as `inkwell.service`, and so on.
"""

from setuptools import find_packages, setup

# tests/ is not installed
FOLDERS = ["sdk", "service", "serving", "adapters", "trainer", "kernels", "models", "recipes"]

packages = ["inkwell"]
package_dir = {"inkwell": "inkwell"}
for folder in FOLDERS:
    package_dir[f"inkwell.{folder}"] = folder
    packages.append(f"inkwell.{folder}")
    packages += [f"inkwell.{folder}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
