"""Build hook: generates the gRPC stubs of corral.proto into the package while building.

The protos are read from `proto/` beside this file (a link to the repository's `proto/`), or
from `../proto` when the link was not kept; nothing generated is committed.
"""

import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ["corral.proto"]


def proto_dir():
    for candidate in (os.path.join(HERE, "proto"), os.path.join(HERE, "..", "proto")):
        if all(os.path.isfile(os.path.join(candidate, p)) for p in PROTOS):
            return candidate
    raise RuntimeError(
        "corral.proto not found: build from a checkout of the corral repository (python/proto links to ../proto)"
    )


def generate(out_dir):
    """Writes corral_client/_proto/corral_pb2*.py under out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    package = os.path.join("corral_client", "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        # Placing the protos under the package path makes the stubs import each other
        # as corral_client._proto.*, not as top-level modules.
        os.makedirs(os.path.join(tmp, package))
        for p in PROTOS:
            shutil.copy(os.path.join(proto_dir(), p), os.path.join(tmp, package, p))
        os.makedirs(os.path.join(out_dir, package), exist_ok=True)
        include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        args = ["grpc_tools.protoc", f"-I{tmp}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
        args += [os.path.join(tmp, package, p) for p in PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTOS}")
    with open(os.path.join(out_dir, package, "__init__.py"), "w") as f:
        f.write('"""Generated from proto/corral.proto while building; not committed."""\n')


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        generate(self.build_lib)


def requirements():
    """At least the grpcio and protobuf the stubs were generated with: newer stubs refuse older runtimes."""
    from google import protobuf

    try:
        from importlib.metadata import version

        tools = version("grpcio-tools")
    except Exception:
        tools = "1.62.0"
    pb = ".".join(protobuf.__version__.split(".")[:2])
    return [f"grpcio>={tools}", f"protobuf>={pb}"]


setup(cmdclass={"build_py": BuildWithStubs}, install_requires=requirements())
