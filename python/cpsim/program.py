"""The cpsim program (the C++ command line) from Python: where it is, and the
`cpsim` console entry that runs it (pip install puts both in place)."""
import os
import shutil
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def binary():
    """The cpsim program the harness and the console entry run: $CPSIM_BINARY, else
    the build tree's (build/python), else the installed package's (cpsim/bin), else
    the one on the PATH."""
    named = os.environ.get("CPSIM_BINARY")
    if named:
        return named
    try:
        from cpsim._build import CPSIM_BINARY  # written by the CMake build, in the build tree only
        return CPSIM_BINARY
    except ImportError:
        pass
    packaged = os.path.join(_HERE, "bin", "cpsim")
    if os.access(packaged, os.X_OK):
        return packaged
    found = shutil.which("cpsim")
    if found and os.path.realpath(found) != os.path.realpath(sys.argv[0] if sys.argv else ""):
        return found
    raise FileNotFoundError("cpsim: the cpsim program was not found: install the package (pip install . from the "
                            "repository), build it (make: build/cpsim), or name it with CPSIM_BINARY")


def main():
    """`cpsim ...`: the program, with this process's arguments (it replaces this process)."""
    program = binary()
    os.execv(program, ["cpsim"] + sys.argv[1:])


if __name__ == "__main__":
    main()
