"""Builds FlashMLA's sm90 dense bf16 decode as `flash_mla.cuda`, in place, run from an unpacked
FlashMLA tree by bench/flashmla_build.sh and by Dockerfile.cuda (FlashMLA's own setup.py builds
every kernel, sm100 and sparse included, and runs `git submodule update`).

What is compiled: our binding (scripts/flashmla_bindings.cpp, `dense_decode_fwd` only), the
scheduler-metadata and combine kernels, and the bf16 dense decode kernel; for sm_90a alone, with
FlashMLA's own nvcc flags (fp16 left out: FLASH_MLA_DISABLE_FP16). Torch's BuildExtension compiles
the four units in parallel through ninja where it imports (MAX_JOBS), else one after another.

    cd FlashMLA && MAX_JOBS=16 python3 /path/to/scripts/flashmla_setup.py /path/to/scripts/flashmla_bindings.cpp
    ... [--install]: then copies the built package (flash_mla/) into this Python's site-packages
"""
import os
import shutil
import sys
import sysconfig

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

binding = sys.argv[1]
sys.argv[2:] = [a for a in sys.argv[2:] if a != "--install"]
shutil.copy(binding, "csrc/deepseek_pd_bindings.cpp")  # beside api/, where its include resolves
SOURCES = ["csrc/deepseek_pd_bindings.cpp",
           "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
           "csrc/smxx/decode/combine/combine.cu",
           "csrc/sm90/decode/dense/instantiations/bf16.cu"]
FEATURES = ["-DFLASH_MLA_DISABLE_FP16"]
CXX = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"] + FEATURES
NVCC = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "--use_fast_math", "--ptxas-options=--register-usage-level=10",
        # An explicit -gencode keeps torch from adding TORCH_CUDA_ARCH_LIST's: the kernel needs sm_90a's wgmma.
        "-gencode", "arch=compute_90a,code=sm_90a", "--threads", os.environ.get("NVCC_THREADS", "4")] + FEATURES
INCLUDES = [os.path.abspath(p) for p in ("csrc", "csrc/kerutils/include", "csrc/sm90", "csrc/cutlass/include",
                                          "csrc/cutlass/tools/util/include")]
# CUDA 13 keeps libcu++ (<cuda/std/...>, which CUTLASS includes) under include/cccl: nvcc searches it
# by itself, g++ compiling the binding does not ("cuda/std/utility: No such file" on the lent H100).
CCCL = os.path.join(CUDA_HOME or "/usr/local/cuda", "include", "cccl")
if os.path.isdir(CCCL):
    INCLUDES.append(CCCL)

setup(name="flash_mla", version="1.0.0", packages=["flash_mla"], script_args=["build_ext", "--inplace"],
      cmdclass={"build_ext": BuildExtension},
      ext_modules=[CUDAExtension("flash_mla.cuda", SOURCES, include_dirs=INCLUDES,
                                 extra_compile_args={"cxx": CXX, "nvcc": NVCC})])

if "--install" in sys.argv[2:]:
    target = os.path.join(sysconfig.get_paths()["purelib"], "flash_mla")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree("flash_mla", target)
