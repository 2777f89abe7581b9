"""Live checkpoint transfer for healing replicas: a safe wire format and two transports."""

from ft_core.checkpointing.http_transport import HTTPTransport
from ft_core.checkpointing.pg_transport import PGTransport
from ft_core.checkpointing.serialization import dumps, encode, loads, parse_header_frame
from ft_core.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport", "dumps", "encode", "loads", "parse_header_frame"]
