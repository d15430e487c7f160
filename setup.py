"""Build hook: the gRPC stubs are generated when the package is built, never committed.

Every build path runs ``build_py`` (``pip wheel .``, ``python -m build``, ``pip install .``, and
editable installs, which ``make setup`` uses). This one first runs protoc from grpcio-tools (a
build requirement in pyproject.toml) on ``proto/specsplit/v1/*.proto``. protoc writes the stubs
where their proto package puts them, so they import as ``specsplit.v1.speculative_pb2`` with no
rewriting: into the build tree for a wheel, beside the .proto for an editable install.
Everything else about the package is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_ROOT = Path(__file__).resolve().parent / "proto"


def generate_stubs(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()  # a no-op in editable mode
        # After the copy, so stubs left in the checkout by an editable install never replace the
        # ones generated now from the current .proto.
        generate_stubs(PROTO_ROOT if self.editable_mode else Path(self.build_lib))


setup(cmdclass={"build_py": BuildPyWithStubs})
