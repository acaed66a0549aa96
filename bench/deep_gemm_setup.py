"""Builds DeepGEMM's host extension (`deep_gemm._C`) in place, run from an unpacked DeepGEMM tree by
bench/deep_gemm_build.sh: setuptools' build_ext through torch's BuildExtension (ninja where it is
installed, else the plain compiler: the GPU image may lack ninja, which cpp_extension.load needs),
with the flags and include folders of DeepGEMM's own setup.py, which is not used (it wants `wheel`
and a git tree).
"""
import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

FLAGS = ["-std=c++17", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
INCLUDES = [f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl", "deep_gemm/include",
            "third-party/cutlass/include", "third-party/fmt/include"]

setup(name="deep_gemm_host", script_args=["build_ext", "--inplace"], cmdclass={"build_ext": BuildExtension},
      ext_modules=[CUDAExtension("deep_gemm._C", ["csrc/python_api.cpp"], include_dirs=INCLUDES,
                                 libraries=["cudart", "nvrtc"], library_dirs=[f"{CUDA_HOME}/lib64"],
                                 extra_compile_args={"cxx": FLAGS})])
