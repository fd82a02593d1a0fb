"""Compiles protocols/*.proto into the gitignored package peerd/proto/ at build time, and the codec's C kernel.

The generated modules are never committed or hand-edited: every build (wheel, sdist, editable) makes them
anew from the schemas, so the wire format has exactly one source of truth. The kernel
(peerd/wire/_blockwise.c, plain C with the Python headers) is optional: without a C compiler the build goes
on and the codec encodes with torch (peerd.wire.blockwise.kernel() says which).
"""

from __future__ import annotations

import glob
import os
import warnings

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.warnings import InformationOnly

# setuptools notes on every editable install of a flat layout (peerd/ beside this file) that a folder named
# peerd in the working directory could shadow the package, and pip prints it as a 10-line warning of the
# build; it holds for any flat layout and asks nothing of the user. Only this note is silenced.
warnings.filterwarnings("ignore", message=r"Editable installation\.", category=InformationOnly)

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_protos() -> None:
    from grpc_tools import protoc  # build-system requirement

    out_dir = os.path.join(HERE, "peerd", "proto")
    os.makedirs(out_dir, exist_ok=True)
    sources = sorted(glob.glob(os.path.join(HERE, "protocols", "*.proto")))
    if not sources:
        return
    # Schemas are self-contained (no imports between .proto files), so the generated modules need no
    # import rewriting, unlike hivemind's. File names start with "peerd_" because protobuf's default
    # descriptor pool is keyed by file name and hivemind already registers e.g. "averaging.proto".
    args = ["grpc_tools.protoc", f"-I{os.path.join(HERE, 'protocols')}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    init = os.path.join(out_dir, "__init__.py")
    with open(init, "w") as f:
        f.write('"""Generated from protocols/*.proto at build time; do not edit."""\n')


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        compile_protos()
        # setup() listed the packages before peerd/proto existed in a clean tree; add it so wheels carry it.
        if self.packages is not None and "peerd.proto" not in self.packages:
            self.packages.append("peerd.proto")
        super().run()


KERNEL = Extension(
    "peerd.wire._blockwise",
    sources=["peerd/wire/_blockwise.c"],
    # -O3 for the vectorized loops; no -ffast-math, which would change the codec's rounding.
    extra_compile_args=["-O3", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)

setup(cmdclass={"build_py": BuildPyWithProtos}, ext_modules=[KERNEL])
