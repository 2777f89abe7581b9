"""The committed protobuf/gRPC stubs match ft_core/control/proto/ft.proto (regenerate: python scripts/gen_proto.py),
and the control plane's values (ft_core.control.types) survive the wire unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ft_core.control.proto import ft_pb2
from ft_core.control.types import Quorum, QuorumMember

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_committed_stubs_match_the_proto() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, (f"generated stubs drifted from ft.proto; run `python scripts/gen_proto.py` "
                                    f"and commit the result:\n{result.stdout}{result.stderr}")


def test_stubs_expose_the_services_of_the_design() -> None:
    from ft_core.control.proto import ft_pb2, ft_pb2_grpc

    lighthouse = ft_pb2.DESCRIPTOR.services_by_name["LighthouseService"]
    # Peer: lighthouse to lighthouse (ft_core.control.lighthouse_peers)
    assert [m.name for m in lighthouse.methods] == ["Quorum", "Heartbeat", "HeartbeatStream", "Peer"]
    stream = lighthouse.methods_by_name["HeartbeatStream"]
    assert stream.client_streaming and stream.server_streaming
    manager = ft_pb2.DESCRIPTOR.services_by_name["ManagerService"]
    # PeerLostNotices: group rank 0's server forwards the lighthouse's PeerLost to its other ranks (control/notices.py)
    assert {m.name for m in manager.methods} == {"Quorum", "CheckpointMetadata", "ShouldCommit", "Kill",
                                                 "PeerLostNotices"}
    notices = manager.methods_by_name["PeerLostNotices"]
    assert notices.server_streaming and not notices.client_streaming
    assert hasattr(ft_pb2_grpc, "LighthouseServiceStub") and hasattr(ft_pb2_grpc, "ManagerServiceStub")


@pytest.mark.parametrize("member", [
    QuorumMember("a"),
    QuorumMember("b", address="10.0.0.2:1", store_address="10.0.0.2:2", step=7, world_size=4, shrink_only=True,
                 data='{"k": 1}', commit_failures=2, last_quorum_id=9, unreachable=("c", "d"), commit_quorum_id=8,
                 last_quorum_replica_ids=("a", "b", "c"), rebuild=True, redo_quorum_id=6,
                 reductions="3680522 values (1a2b3c4d)"),
    QuorumMember("c", unreachable=("a",)),
    QuorumMember("d", last_quorum_replica_ids=("d",)),
], ids=["defaults", "every field", "unreachable only", "last quorum only"])
def test_quorum_member_and_quorum_survive_the_wire(member: QuorumMember) -> None:
    decoded = QuorumMember.from_pb(ft_pb2.QuorumMember.FromString(member.to_pb().SerializeToString()))
    assert decoded == member
    assert type(decoded.unreachable) is tuple and type(decoded.last_quorum_replica_ids) is tuple
    quorum = Quorum(3, (member, QuorumMember("z", step=1)), created_unix_ms=5)
    assert Quorum.from_pb(ft_pb2.Quorum.FromString(quorum.to_pb().SerializeToString())) == quorum
