"""Prints what CMake needs to build cpsim._C against the torch a Python has:
its version, its include folders (','-separated) and its library folder, one
line each (python/CMakeLists.txt reads them).

The torch is the one of the environment the package is installed into. Under
pip's build isolation that environment's site-packages are off sys.path (the
build runs with the same interpreter, so its sysconfig paths still name them):
they are put back at the end of sys.path, so a build requirement never shadows
the user's own torch, and torch is never a build requirement of its own (a
second copy of torch, maybe another version, would give a module built against
the wrong ABI).
"""
import os
import sys
import sysconfig


def _import_torch():
    try:
        import torch
        return torch
    except ImportError:
        pass
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path and os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)
    try:
        import torch
        return torch
    except ImportError:
        sys.exit(f"cpsim: no torch in {sysconfig.get_paths()['purelib']} (the Python at {sys.executable}); "
                 "install torch 2.x there first")


def main():
    torch = _import_torch()
    root = os.path.dirname(os.path.abspath(torch.__file__))
    includes = [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include")]
    print(torch.__version__)
    print(",".join(includes))
    print(os.path.join(root, "lib"))


if __name__ == "__main__":
    main()
