"""Builds cpsim's torch.distributed backend (cpsim._C) against the torch that is
installed, with torch's own build helper (its C++ standard, ABI flag and
pybind11):

    pip install --no-build-isolation ./python      # from the repository root

--no-build-isolation: the build must see the user's torch, not a fresh copy.
The module holds cpsim's communication layer and CPU backends (core/, sim/),
compiled from the repository's sources; it needs Debian's libgloo-dev and
libhiredis-dev (scripts/install-deps.sh). The harness (cpsim.torch.check) runs
the cpsim executable: on the PATH, or named by CPSIM_BINARY.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)

# What the backend is made of: the tensor basics and the communication layer of
# core/, and every CPU backend, job and launcher of sim/ (their files in CMake's
# cpsim_core and cpsim_sim; the layers and kernels are not needed here).
patterns = ["core/error.cpp", "core/device.cpp", "core/tensor.cpp", "core/reduce.cpp", "core/tensor_wire.cpp",
            "core/kernels/host.cpp", "core/comm/*.cpp", "sim/**/*.cpp"]
sources = sorted(os.path.join("torch_backend", f) for f in os.listdir(os.path.join(here, "torch_backend"))
                 if f.endswith(".cpp"))
for pattern in patterns:
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
        sources.append(os.path.relpath(path, here))

# The host kernels are the one kernel source (Thrust/CUB): the CUDA toolkit's
# CCCL, else Debian's libthrust-dev.
thrust = next((d for d in ("/usr/local/cuda/include/cccl", "/usr/local/cuda/targets/x86_64-linux/include/cccl",
                           "/usr/include") if os.path.exists(os.path.join(d, "thrust", "version.h"))), None)
if thrust is None:
    raise SystemExit("cpsim: Thrust headers not found (install the CUDA toolkit or Debian's libthrust-dev)")

extension = CppExtension(
    "cpsim._C",
    sources,
    include_dirs=[root],
    # cpsim's core is C++20; older torch builds extensions as C++17 (2.10 does;
    # its headers compile as C++20 too): the later -std wins.
    extra_compile_args=["-O2", "-g0", "-fvisibility=hidden", "-isystem", thrust, "-DHIREDIS_NESTED_INCLUDE", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-std=c++20"],
    # gloo first: torch's own library holds a different Gloo, and this module's
    # Gloo calls must bind to the one it was compiled against (the libraries are
    # searched in this order).
    libraries=["gloo", "hiredis"],
    # Backends register through static objects: nothing may be dropped.
    extra_link_args=["-Wl,--no-as-needed"],
)

setup(
    name="cpsim",
    version="0.5.0",
    description="cpsim's torch.distributed backend and property harness for context-parallel code",
    packages=["cpsim"],
    package_dir={"cpsim": "cpsim"},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
)
