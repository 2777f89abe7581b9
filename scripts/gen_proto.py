"""Regenerate ft_core/control/proto/ft_pb2*.py from ft.proto (needs grpcio-tools; run from any directory).

`python scripts/gen_proto.py --check` exits non-zero when the committed stubs differ.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "ft_core" / "control" / "proto"
OUTPUTS = ("ft_pb2.py", "ft_pb2.pyi", "ft_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) and rewrite the grpc stub's import to a package-relative one."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO_DIR / "ft.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    grpc_stub = out_dir / "ft_pb2_grpc.py"
    text = grpc_stub.read_text().replace("import ft_pb2 as ft__pb2", "from . import ft_pb2 as ft__pb2")
    grpc_stub.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        generate(out)
        drift = [name for name in OUTPUTS
                 if not (PROTO_DIR / name).exists() or (PROTO_DIR / name).read_text() != (out / name).read_text()]
        if opts.check:
            if drift:
                print(f"stubs out of date: {', '.join(drift)}; run python scripts/gen_proto.py", file=sys.stderr)
                return 1
            return 0
        for name in OUTPUTS:
            (PROTO_DIR / name).write_text((out / name).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
