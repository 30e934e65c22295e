"""Builds fusedoff._C: the C++ sources always, the CUDA sources whenever a toolkit is found.

See fusedoff/_build.py for the environment switches (CUDA_HOME, FUSEDOFF_CUDA,
TORCH_CUDA_ARCH_LIST, MAX_JOBS). Install with ``pip install --no-build-isolation -e .`` so the
build uses the torch you run with. The version comes from ``fusedoff/__init__.py`` (pyproject.toml).
"""

import importlib.util
import sys
import sysconfig
from pathlib import Path

import setuptools
from setuptools import find_packages, setup

# Older setuptools rejects pyproject.toml's SPDX license string with an unhelpful validation error;
# under --no-build-isolation the build uses whatever setuptools the environment has.
if int(setuptools.__version__.split(".")[0]) < 77:
    raise SystemExit(f"fusedoff: building needs setuptools>=77, this environment has {setuptools.__version__}: "
                     "pip install 'setuptools>=77' ninja")

_spec = importlib.util.spec_from_file_location("fusedoff_build", Path(__file__).parent / "fusedoff" / "_build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

cuda_home = build.find_cuda_home()
with_cuda = build.cuda_build_requested(cuda_home)
if with_cuda:
    build.prepare_cuda_environment(cuda_home)

from torch.utils import cpp_extension  # noqa: E402  (after CUDA_HOME is settled)

Extension = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
print(f"fusedoff: building {build.EXTENSION_NAME} with{'' if with_cuda else 'out'} CUDA"
      + (f" (toolkit {cuda_home}, arch {__import__('os').environ['TORCH_CUDA_ARCH_LIST']})" if with_cuda else ""))


def _relative(paths):
    return [str(Path(s).relative_to(Path(__file__).resolve().parent)) for s in paths]


ext_modules = [
    Extension(
        name=build.EXTENSION_NAME,
        sources=_relative(build.sources(with_cuda)),
        include_dirs=build.include_dirs(),
        extra_compile_args=build.compile_args(with_cuda),
        extra_link_args=build.link_args(),
        py_limited_api=True,  # see [note: one binary for every torch] in csrc/ops.cpp
    )
]
if build.emulation_requested():  # the tests' emulated CUDA kernels (FUSEDOFF_CUDA_EMULATION=1; never in wheels)
    print(f"fusedoff: building {build.EMULATED_EXTENSION_NAME} (the CUDA kernels on the host, for the tests)")
    ext_modules.append(
        cpp_extension.CppExtension(
            name=build.EMULATED_EXTENSION_NAME,
            sources=_relative([*build.emulation_kernel_sources(), build.emulation_runtime_source()]),
            include_dirs=build.emulation_include_dirs(),
            extra_compile_args={"cxx": build.emulation_compile_args()},
            py_limited_api=True,
        )
    )

class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """One object folder whichever way the build runs: an editable install (make test's, which pip would
    otherwise build in a temporary folder it deletes), `pip wheel` (make wheel) or `build_ext --inplace`.
    ninja then compiles only what changed or what another route compiled with other flags: make wheel
    links make test's objects, and make test rebuilds incrementally."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = str(Path(__file__).resolve().parent / "build"
                              / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")


setup(
    packages=find_packages(include=["fusedoff", "fusedoff.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": build.ABI3_TAG}},  # one wheel for every CPython >= 3.10
)
