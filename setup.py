"""Maps the top-level folders into the `deepseek_pd` import namespace.

The folders operator/, model/, proto/ and workers/ are not import names on their own
(`operator` would shadow the stdlib), so each becomes `deepseek_pd.<folder>`. Subpackages
are discovered, so a new folder with an __init__.py needs no edit here.
"""

from setuptools import find_packages, setup

MAPPED_FOLDERS = ("model", "workers", "proto", "operator")


def _packages_and_dirs() -> tuple[list[str], dict[str, str]]:
    packages = ["deepseek_pd"] + [f"deepseek_pd.{p}" for p in find_packages("deepseek_pd")]
    package_dir = {"deepseek_pd": "deepseek_pd"}
    for folder in MAPPED_FOLDERS:
        root = f"deepseek_pd.{folder}"
        package_dir[root] = folder
        packages.append(root)
        packages += [f"{root}.{p}" for p in find_packages(folder)]
    return packages, package_dir


packages, package_dir = _packages_and_dirs()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"deepseek_pd.proto": ["*.proto"],
                  "deepseek_pd.gateway_guard": ["*.wasm", "*.wat", "wit/*.wit"]},
    include_package_data=True,
)
