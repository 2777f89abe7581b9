from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuorumMember(_message.Message):
    __slots__ = ("replica_id", "address", "store_address", "step", "world_size", "shrink_only", "data", "commit_failures", "last_quorum_id", "unreachable", "commit_quorum_id", "last_quorum_replica_ids", "rebuild", "redo_quorum_id", "reductions", "restarted")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_QUORUM_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    REDO_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REDUCTIONS_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: str
    commit_failures: int
    last_quorum_id: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    commit_quorum_id: int
    last_quorum_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    rebuild: bool
    redo_quorum_id: int
    reductions: str
    restarted: bool
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., store_address: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., shrink_only: _Optional[bool] = ..., data: _Optional[str] = ..., commit_failures: _Optional[int] = ..., last_quorum_id: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ..., commit_quorum_id: _Optional[int] = ..., last_quorum_replica_ids: _Optional[_Iterable[str]] = ..., rebuild: _Optional[bool] = ..., redo_quorum_id: _Optional[int] = ..., reductions: _Optional[str] = ..., restarted: _Optional[bool] = ...) -> None: ...

class Quorum(_message.Message):
    __slots__ = ("quorum_id", "participants", "created_unix_ms")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    participants: _containers.RepeatedCompositeFieldContainer[QuorumMember]
    created_unix_ms: int
    def __init__(self, quorum_id: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[QuorumMember, _Mapping]]] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class LighthouseQuorumRequest(_message.Message):
    __slots__ = ("requester",)
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    requester: QuorumMember
    def __init__(self, requester: _Optional[_Union[QuorumMember, _Mapping]] = ...) -> None: ...

class LighthouseQuorumResponse(_message.Message):
    __slots__ = ("quorum",)
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    quorum: Quorum
    def __init__(self, quorum: _Optional[_Union[Quorum, _Mapping]] = ...) -> None: ...

class LighthouseHeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "leaving", "request_id", "quorum", "timeout_ms", "finished", "finished_step", "finished_quorum_id", "want_status", "want_frames_port", "gave_up_quorum_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    WANT_STATUS_FIELD_NUMBER: _ClassVar[int]
    WANT_FRAMES_PORT_FIELD_NUMBER: _ClassVar[int]
    GAVE_UP_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    leaving: bool
    request_id: int
    quorum: LighthouseQuorumRequest
    timeout_ms: int
    finished: bool
    finished_step: int
    finished_quorum_id: int
    want_status: bool
    want_frames_port: bool
    gave_up_quorum_id: int
    def __init__(self, replica_id: _Optional[str] = ..., leaving: _Optional[bool] = ..., request_id: _Optional[int] = ..., quorum: _Optional[_Union[LighthouseQuorumRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., finished: _Optional[bool] = ..., finished_step: _Optional[int] = ..., finished_quorum_id: _Optional[int] = ..., want_status: _Optional[bool] = ..., want_frames_port: _Optional[bool] = ..., gave_up_quorum_id: _Optional[int] = ...) -> None: ...

class PeerLost(_message.Message):
    __slots__ = ("quorum_id", "replica_id", "reason")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    replica_id: str
    reason: str
    def __init__(self, quorum_id: _Optional[int] = ..., replica_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LighthouseHeartbeatResponse(_message.Message):
    __slots__ = ("peer_lost", "request_id", "quorum_response", "error_code", "error", "quorum_status", "frames_port")
    PEER_LOST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUORUM_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUORUM_STATUS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_PORT_FIELD_NUMBER: _ClassVar[int]
    peer_lost: PeerLost
    request_id: int
    quorum_response: bytes
    error_code: str
    error: str
    quorum_status: str
    frames_port: int
    def __init__(self, peer_lost: _Optional[_Union[PeerLost, _Mapping]] = ..., request_id: _Optional[int] = ..., quorum_response: _Optional[bytes] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ..., quorum_status: _Optional[str] = ..., frames_port: _Optional[int] = ...) -> None: ...

class LighthousePeerState(_message.Message):
    __slots__ = ("lighthouse_id", "address", "live_members", "max_step", "quorum_id", "standing_by_for")
    LIGHTHOUSE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    STANDING_BY_FOR_FIELD_NUMBER: _ClassVar[int]
    lighthouse_id: str
    address: str
    live_members: int
    max_step: int
    quorum_id: int
    standing_by_for: str
    def __init__(self, lighthouse_id: _Optional[str] = ..., address: _Optional[str] = ..., live_members: _Optional[int] = ..., max_step: _Optional[int] = ..., quorum_id: _Optional[int] = ..., standing_by_for: _Optional[str] = ...) -> None: ...

class ManagerQuorumRequest(_message.Message):
    __slots__ = ("group_rank", "step", "checkpoint_metadata", "shrink_only", "init_sync", "commit_failures", "commit_quorum_id", "rebuild", "redo_quorum_id")
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_METADATA_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    INIT_SYNC_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    REDO_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    step: int
    checkpoint_metadata: str
    shrink_only: bool
    init_sync: bool
    commit_failures: int
    commit_quorum_id: int
    rebuild: bool
    redo_quorum_id: int
    def __init__(self, group_rank: _Optional[int] = ..., step: _Optional[int] = ..., checkpoint_metadata: _Optional[str] = ..., shrink_only: _Optional[bool] = ..., init_sync: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., commit_quorum_id: _Optional[int] = ..., rebuild: _Optional[bool] = ..., redo_quorum_id: _Optional[int] = ...) -> None: ...

class ManagerQuorumResponse(_message.Message):
    __slots__ = ("quorum_id", "recover_src_manager_address", "recover_src_replica_rank", "recover_dst_replica_ranks", "store_address", "max_step", "max_replica_rank", "max_world_size", "replica_rank", "replica_world_size", "heal", "commit_failures", "replica_ids", "redo_quorum_id")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SRC_MANAGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SRC_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    RECOVER_DST_REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    REDO_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    recover_src_manager_address: str
    recover_src_replica_rank: int
    recover_dst_replica_ranks: _containers.RepeatedScalarFieldContainer[int]
    store_address: str
    max_step: int
    max_replica_rank: int
    max_world_size: int
    replica_rank: int
    replica_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    redo_quorum_id: int
    def __init__(self, quorum_id: _Optional[int] = ..., recover_src_manager_address: _Optional[str] = ..., recover_src_replica_rank: _Optional[int] = ..., recover_dst_replica_ranks: _Optional[_Iterable[int]] = ..., store_address: _Optional[str] = ..., max_step: _Optional[int] = ..., max_replica_rank: _Optional[int] = ..., max_world_size: _Optional[int] = ..., replica_rank: _Optional[int] = ..., replica_world_size: _Optional[int] = ..., heal: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ..., redo_quorum_id: _Optional[int] = ...) -> None: ...

class CheckpointMetadataRequest(_message.Message):
    __slots__ = ("group_rank",)
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    def __init__(self, group_rank: _Optional[int] = ...) -> None: ...

class CheckpointMetadataResponse(_message.Message):
    __slots__ = ("checkpoint_metadata",)
    CHECKPOINT_METADATA_FIELD_NUMBER: _ClassVar[int]
    checkpoint_metadata: str
    def __init__(self, checkpoint_metadata: _Optional[str] = ...) -> None: ...

class ShouldCommitRequest(_message.Message):
    __slots__ = ("should_commit", "group_rank", "step", "healed", "redoable")
    SHOULD_COMMIT_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HEALED_FIELD_NUMBER: _ClassVar[int]
    REDOABLE_FIELD_NUMBER: _ClassVar[int]
    should_commit: bool
    group_rank: int
    step: int
    healed: bool
    redoable: bool
    def __init__(self, should_commit: _Optional[bool] = ..., group_rank: _Optional[int] = ..., step: _Optional[int] = ..., healed: _Optional[bool] = ..., redoable: _Optional[bool] = ...) -> None: ...

class ShouldCommitResponse(_message.Message):
    __slots__ = ("should_commit", "all_healed", "all_redoable")
    SHOULD_COMMIT_FIELD_NUMBER: _ClassVar[int]
    ALL_HEALED_FIELD_NUMBER: _ClassVar[int]
    ALL_REDOABLE_FIELD_NUMBER: _ClassVar[int]
    should_commit: bool
    all_healed: bool
    all_redoable: bool
    def __init__(self, should_commit: _Optional[bool] = ..., all_healed: _Optional[bool] = ..., all_redoable: _Optional[bool] = ...) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("msg",)
    MSG_FIELD_NUMBER: _ClassVar[int]
    msg: str
    def __init__(self, msg: _Optional[str] = ...) -> None: ...

class KillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerLostNoticesRequest(_message.Message):
    __slots__ = ("after_seq",)
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    def __init__(self, after_seq: _Optional[int] = ...) -> None: ...

class PeerLostNotice(_message.Message):
    __slots__ = ("seq", "peer_lost")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PEER_LOST_FIELD_NUMBER: _ClassVar[int]
    seq: int
    peer_lost: PeerLost
    def __init__(self, seq: _Optional[int] = ..., peer_lost: _Optional[_Union[PeerLost, _Mapping]] = ...) -> None: ...
