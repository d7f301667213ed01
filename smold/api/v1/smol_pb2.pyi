import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MachineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MACHINE_STATE_UNSPECIFIED: _ClassVar[MachineState]
    MACHINE_STATE_CREATING: _ClassVar[MachineState]
    MACHINE_STATE_RUNNING: _ClassVar[MachineState]
    MACHINE_STATE_PAUSED: _ClassVar[MachineState]
    MACHINE_STATE_STOPPING: _ClassVar[MachineState]
    MACHINE_STATE_STOPPED: _ClassVar[MachineState]
    MACHINE_STATE_FAILED: _ClassVar[MachineState]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_PASS: _ClassVar[Outcome]
    OUTCOME_FAIL: _ClassVar[Outcome]
    OUTCOME_VERIFIER_ERROR: _ClassVar[Outcome]
    OUTCOME_INFRA_ERROR: _ClassVar[Outcome]
    OUTCOME_INTERRUPTED: _ClassVar[Outcome]

class CopyFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COPY_FORMAT_UNSPECIFIED: _ClassVar[CopyFormat]
    COPY_FORMAT_FILE: _ClassVar[CopyFormat]
    COPY_FORMAT_TAR: _ClassVar[CopyFormat]

class ResultState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_STATE_UNSPECIFIED: _ClassVar[ResultState]
    RESULT_STATE_RUNNING: _ClassVar[ResultState]
    RESULT_STATE_DONE: _ClassVar[ResultState]
    RESULT_STATE_INTERRUPTED: _ClassVar[ResultState]
MACHINE_STATE_UNSPECIFIED: MachineState
MACHINE_STATE_CREATING: MachineState
MACHINE_STATE_RUNNING: MachineState
MACHINE_STATE_PAUSED: MachineState
MACHINE_STATE_STOPPING: MachineState
MACHINE_STATE_STOPPED: MachineState
MACHINE_STATE_FAILED: MachineState
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_PASS: Outcome
OUTCOME_FAIL: Outcome
OUTCOME_VERIFIER_ERROR: Outcome
OUTCOME_INFRA_ERROR: Outcome
OUTCOME_INTERRUPTED: Outcome
COPY_FORMAT_UNSPECIFIED: CopyFormat
COPY_FORMAT_FILE: CopyFormat
COPY_FORMAT_TAR: CopyFormat
RESULT_STATE_UNSPECIFIED: ResultState
RESULT_STATE_RUNNING: ResultState
RESULT_STATE_DONE: ResultState
RESULT_STATE_INTERRUPTED: ResultState

class Machine(_message.Message):
    __slots__ = ("id", "name", "state", "cpus", "memory_mib", "image", "image_digest", "smolfile_digest", "created_at", "failure_reason", "console_tail", "vmm_pid", "restored_from", "network", "forwarded_ports")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    CONSOLE_TAIL_FIELD_NUMBER: _ClassVar[int]
    VMM_PID_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_PORTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: MachineState
    cpus: int
    memory_mib: int
    image: str
    image_digest: str
    smolfile_digest: str
    created_at: _timestamp_pb2.Timestamp
    failure_reason: str
    console_tail: str
    vmm_pid: int
    restored_from: str
    network: NetworkReport
    forwarded_ports: _containers.RepeatedCompositeFieldContainer[ForwardedPort]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[MachineState, str]] = ..., cpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., image: _Optional[str] = ..., image_digest: _Optional[str] = ..., smolfile_digest: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failure_reason: _Optional[str] = ..., console_tail: _Optional[str] = ..., vmm_pid: _Optional[int] = ..., restored_from: _Optional[str] = ..., network: _Optional[_Union[NetworkReport, _Mapping]] = ..., forwarded_ports: _Optional[_Iterable[_Union[ForwardedPort, _Mapping]]] = ...) -> None: ...

class ForwardedPort(_message.Message):
    __slots__ = ("guest_port", "host_address", "host_port")
    GUEST_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_PORT_FIELD_NUMBER: _ClassVar[int]
    guest_port: int
    host_address: str
    host_port: int
    def __init__(self, guest_port: _Optional[int] = ..., host_address: _Optional[str] = ..., host_port: _Optional[int] = ...) -> None: ...

class DeniedDestination(_message.Message):
    __slots__ = ("address", "protocol", "port", "packets")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    address: str
    protocol: str
    port: int
    packets: int
    def __init__(self, address: _Optional[str] = ..., protocol: _Optional[str] = ..., port: _Optional[int] = ..., packets: _Optional[int] = ...) -> None: ...

class NetworkCounter(_message.Message):
    __slots__ = ("name", "packets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    packets: int
    def __init__(self, name: _Optional[str] = ..., packets: _Optional[int] = ...) -> None: ...

class DeniedName(_message.Message):
    __slots__ = ("name", "queries")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    queries: int
    def __init__(self, name: _Optional[str] = ..., queries: _Optional[int] = ...) -> None: ...

class NetworkReport(_message.Message):
    __slots__ = ("counters", "denied", "denied_names", "denied_dns_queries")
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DENIED_FIELD_NUMBER: _ClassVar[int]
    DENIED_NAMES_FIELD_NUMBER: _ClassVar[int]
    DENIED_DNS_QUERIES_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.RepeatedCompositeFieldContainer[NetworkCounter]
    denied: _containers.RepeatedCompositeFieldContainer[DeniedDestination]
    denied_names: _containers.RepeatedCompositeFieldContainer[DeniedName]
    denied_dns_queries: int
    def __init__(self, counters: _Optional[_Iterable[_Union[NetworkCounter, _Mapping]]] = ..., denied: _Optional[_Iterable[_Union[DeniedDestination, _Mapping]]] = ..., denied_names: _Optional[_Iterable[_Union[DeniedName, _Mapping]]] = ..., denied_dns_queries: _Optional[int] = ...) -> None: ...

class Smolfile(_message.Message):
    __slots__ = ("toml", "spec")
    TOML_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    toml: SmolfileToml
    spec: SmolfileSpec
    def __init__(self, toml: _Optional[_Union[SmolfileToml, _Mapping]] = ..., spec: _Optional[_Union[SmolfileSpec, _Mapping]] = ...) -> None: ...

class SmolfileToml(_message.Message):
    __slots__ = ("text", "base_dir", "filename")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BASE_DIR_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    text: str
    base_dir: str
    filename: str
    def __init__(self, text: _Optional[str] = ..., base_dir: _Optional[str] = ..., filename: _Optional[str] = ...) -> None: ...

class SmolfileSpec(_message.Message):
    __slots__ = ("image", "cpus", "memory_mib", "network", "mounts", "env", "setup", "task", "timeouts", "checks", "base_dir", "verifier_mounts", "verifier_outputs", "verifier_image")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    BASE_DIR_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_MOUNTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: str
    cpus: int
    memory_mib: int
    network: NetworkPolicy
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    env: _containers.ScalarMap[str, str]
    setup: _containers.RepeatedCompositeFieldContainer[Command]
    task: Command
    timeouts: Timeouts
    checks: _containers.RepeatedCompositeFieldContainer[Check]
    base_dir: str
    verifier_mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    verifier_outputs: _containers.RepeatedScalarFieldContainer[str]
    verifier_image: str
    def __init__(self, image: _Optional[str] = ..., cpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., env: _Optional[_Mapping[str, str]] = ..., setup: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., task: _Optional[_Union[Command, _Mapping]] = ..., timeouts: _Optional[_Union[Timeouts, _Mapping]] = ..., checks: _Optional[_Iterable[_Union[Check, _Mapping]]] = ..., base_dir: _Optional[str] = ..., verifier_mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., verifier_outputs: _Optional[_Iterable[str]] = ..., verifier_image: _Optional[str] = ...) -> None: ...

class NetworkPolicy(_message.Message):
    __slots__ = ("allow", "forward", "public", "closed")
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    allow: _containers.RepeatedScalarFieldContainer[str]
    forward: _containers.RepeatedScalarFieldContainer[str]
    public: bool
    closed: bool
    def __init__(self, allow: _Optional[_Iterable[str]] = ..., forward: _Optional[_Iterable[str]] = ..., public: _Optional[bool] = ..., closed: _Optional[bool] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("host_path", "guest_path")
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    GUEST_PATH_FIELD_NUMBER: _ClassVar[int]
    host_path: str
    guest_path: str
    def __init__(self, host_path: _Optional[str] = ..., guest_path: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("shell", "argv", "timeout_seconds", "cwd", "user")
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    shell: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    cwd: str
    user: str
    def __init__(self, shell: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class Timeouts(_message.Message):
    __slots__ = ("boot_seconds", "setup_seconds", "task_seconds", "verify_seconds")
    BOOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SETUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    boot_seconds: float
    setup_seconds: float
    task_seconds: float
    verify_seconds: float
    def __init__(self, boot_seconds: _Optional[float] = ..., setup_seconds: _Optional[float] = ..., task_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ...) -> None: ...

class Check(_message.Message):
    __slots__ = ("name", "timeout_seconds", "command", "file_exists", "file_matches", "http", "reward")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    FILE_EXISTS_FIELD_NUMBER: _ClassVar[int]
    FILE_MATCHES_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    timeout_seconds: float
    command: CommandCheck
    file_exists: FileExistsCheck
    file_matches: FileMatchesCheck
    http: HttpCheck
    reward: RewardCheck
    def __init__(self, name: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., command: _Optional[_Union[CommandCheck, _Mapping]] = ..., file_exists: _Optional[_Union[FileExistsCheck, _Mapping]] = ..., file_matches: _Optional[_Union[FileMatchesCheck, _Mapping]] = ..., http: _Optional[_Union[HttpCheck, _Mapping]] = ..., reward: _Optional[_Union[RewardCheck, _Mapping]] = ...) -> None: ...

class CommandCheck(_message.Message):
    __slots__ = ("shell", "argv", "expect_exit", "cwd", "user")
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    EXPECT_EXIT_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    shell: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    expect_exit: int
    cwd: str
    user: str
    def __init__(self, shell: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., expect_exit: _Optional[int] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class FileExistsCheck(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class FileMatchesCheck(_message.Message):
    __slots__ = ("path", "content", "regex", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    content: str
    regex: str
    sha256: str
    def __init__(self, path: _Optional[str] = ..., content: _Optional[str] = ..., regex: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class HttpCheck(_message.Message):
    __slots__ = ("url", "expect_status", "contains")
    URL_FIELD_NUMBER: _ClassVar[int]
    EXPECT_STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTAINS_FIELD_NUMBER: _ClassVar[int]
    url: str
    expect_status: int
    contains: str
    def __init__(self, url: _Optional[str] = ..., expect_status: _Optional[int] = ..., contains: _Optional[str] = ...) -> None: ...

class RewardCheck(_message.Message):
    __slots__ = ("path", "threshold")
    PATH_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    path: str
    threshold: float
    def __init__(self, path: _Optional[str] = ..., threshold: _Optional[float] = ...) -> None: ...

class Evidence(_message.Message):
    __slots__ = ("exit_code", "output_tail", "duration_ms", "detail", "timed_out")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TAIL_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    output_tail: str
    duration_ms: int
    detail: str
    timed_out: bool
    def __init__(self, exit_code: _Optional[int] = ..., output_tail: _Optional[str] = ..., duration_ms: _Optional[int] = ..., detail: _Optional[str] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class CheckResult(_message.Message):
    __slots__ = ("name", "kind", "passed", "evidence", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    passed: bool
    evidence: Evidence
    error: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., passed: _Optional[bool] = ..., evidence: _Optional[_Union[Evidence, _Mapping]] = ..., error: _Optional[bool] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("passed", "checks", "image_digest", "smolfile_digest", "duration_ms", "outcome", "outcome_detail", "result_id")
    PASSED_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_DETAIL_FIELD_NUMBER: _ClassVar[int]
    RESULT_ID_FIELD_NUMBER: _ClassVar[int]
    passed: bool
    checks: _containers.RepeatedCompositeFieldContainer[CheckResult]
    image_digest: str
    smolfile_digest: str
    duration_ms: int
    outcome: Outcome
    outcome_detail: str
    result_id: str
    def __init__(self, passed: _Optional[bool] = ..., checks: _Optional[_Iterable[_Union[CheckResult, _Mapping]]] = ..., image_digest: _Optional[str] = ..., smolfile_digest: _Optional[str] = ..., duration_ms: _Optional[int] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., outcome_detail: _Optional[str] = ..., result_id: _Optional[str] = ...) -> None: ...

class CreateMachineRequest(_message.Message):
    __slots__ = ("name", "smolfile", "from_checkpoint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    FROM_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    smolfile: Smolfile
    from_checkpoint: str
    def __init__(self, name: _Optional[str] = ..., smolfile: _Optional[_Union[Smolfile, _Mapping]] = ..., from_checkpoint: _Optional[str] = ...) -> None: ...

class CreateMachineResponse(_message.Message):
    __slots__ = ("machine",)
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    machine: Machine
    def __init__(self, machine: _Optional[_Union[Machine, _Mapping]] = ...) -> None: ...

class GetMachineRequest(_message.Message):
    __slots__ = ("machine_id", "console_tail_bytes")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSOLE_TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    console_tail_bytes: int
    def __init__(self, machine_id: _Optional[str] = ..., console_tail_bytes: _Optional[int] = ...) -> None: ...

class GetMachineResponse(_message.Message):
    __slots__ = ("machine",)
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    machine: Machine
    def __init__(self, machine: _Optional[_Union[Machine, _Mapping]] = ...) -> None: ...

class ListMachinesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMachinesResponse(_message.Message):
    __slots__ = ("machines",)
    MACHINES_FIELD_NUMBER: _ClassVar[int]
    machines: _containers.RepeatedCompositeFieldContainer[Machine]
    def __init__(self, machines: _Optional[_Iterable[_Union[Machine, _Mapping]]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("machine_id", "argv", "env", "cwd", "user", "stdin", "timeout_seconds")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    user: str
    stdin: bytes
    timeout_seconds: float
    def __init__(self, machine_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ..., stdin: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("stdout", "stderr", "exit")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit: ExecExit
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[ExecExit, _Mapping]] = ...) -> None: ...

class ExecExit(_message.Message):
    __slots__ = ("exit_code", "signal", "timed_out", "duration_ms")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    timed_out: bool
    duration_ms: int
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., duration_ms: _Optional[int] = ...) -> None: ...

class CopyInRequest(_message.Message):
    __slots__ = ("machine_id", "path", "content", "format", "mode", "mkdirs")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MKDIRS_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    path: str
    content: bytes
    format: CopyFormat
    mode: int
    mkdirs: bool
    def __init__(self, machine_id: _Optional[str] = ..., path: _Optional[str] = ..., content: _Optional[bytes] = ..., format: _Optional[_Union[CopyFormat, str]] = ..., mode: _Optional[int] = ..., mkdirs: _Optional[bool] = ...) -> None: ...

class CopyInResponse(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class CopyOutRequest(_message.Message):
    __slots__ = ("machine_id", "path", "format", "max_size_bytes")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    path: str
    format: CopyFormat
    max_size_bytes: int
    def __init__(self, machine_id: _Optional[str] = ..., path: _Optional[str] = ..., format: _Optional[_Union[CopyFormat, str]] = ..., max_size_bytes: _Optional[int] = ...) -> None: ...

class CopyOutResponse(_message.Message):
    __slots__ = ("content", "size_bytes")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    content: bytes
    size_bytes: int
    def __init__(self, content: _Optional[bytes] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("machine_id", "checks")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    checks: _containers.RepeatedCompositeFieldContainer[Check]
    def __init__(self, machine_id: _Optional[str] = ..., checks: _Optional[_Iterable[_Union[Check, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: VerifyResult
    def __init__(self, result: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...

class DestroyMachineRequest(_message.Message):
    __slots__ = ("machine_id",)
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    def __init__(self, machine_id: _Optional[str] = ...) -> None: ...

class DestroyMachineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetNetworkPolicyRequest(_message.Message):
    __slots__ = ("machine_id", "policy")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    policy: NetworkPolicy
    def __init__(self, machine_id: _Optional[str] = ..., policy: _Optional[_Union[NetworkPolicy, _Mapping]] = ...) -> None: ...

class SetNetworkPolicyResponse(_message.Message):
    __slots__ = ("machine",)
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    machine: Machine
    def __init__(self, machine: _Optional[_Union[Machine, _Mapping]] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("smolfile", "name", "labels", "detach")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    smolfile: Smolfile
    name: str
    labels: _containers.ScalarMap[str, str]
    detach: bool
    def __init__(self, smolfile: _Optional[_Union[Smolfile, _Mapping]] = ..., name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., detach: _Optional[bool] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("name", "ok", "evidence")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    ok: bool
    evidence: Evidence
    def __init__(self, name: _Optional[str] = ..., ok: _Optional[bool] = ..., evidence: _Optional[_Union[Evidence, _Mapping]] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("result", "steps", "machine_id", "error", "duration_ms", "network", "outcome", "outcome_detail", "sealed", "verifier_machine_id", "result_id", "state", "image_digest", "artifacts", "smolfile")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    result: VerifyResult
    steps: _containers.RepeatedCompositeFieldContainer[StepResult]
    machine_id: str
    error: str
    duration_ms: int
    network: NetworkReport
    outcome: Outcome
    outcome_detail: str
    sealed: bool
    verifier_machine_id: str
    result_id: str
    state: ResultState
    image_digest: str
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    smolfile: SmolfileSpec
    def __init__(self, result: _Optional[_Union[VerifyResult, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., machine_id: _Optional[str] = ..., error: _Optional[str] = ..., duration_ms: _Optional[int] = ..., network: _Optional[_Union[NetworkReport, _Mapping]] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., outcome_detail: _Optional[str] = ..., sealed: _Optional[bool] = ..., verifier_machine_id: _Optional[str] = ..., result_id: _Optional[str] = ..., state: _Optional[_Union[ResultState, str]] = ..., image_digest: _Optional[str] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., smolfile: _Optional[_Union[SmolfileSpec, _Mapping]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("machine_id", "count")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    count: int
    def __init__(self, machine_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("machines",)
    MACHINES_FIELD_NUMBER: _ClassVar[int]
    machines: _containers.RepeatedCompositeFieldContainer[Machine]
    def __init__(self, machines: _Optional[_Iterable[_Union[Machine, _Mapping]]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("name", "path", "size_bytes", "created_at", "machine_id", "machine_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    MACHINE_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    size_bytes: int
    created_at: _timestamp_pb2.Timestamp
    machine_id: str
    machine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., machine_id: _Optional[str] = ..., machine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("machine_id", "name")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    name: str
    def __init__(self, machine_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Bake(_message.Message):
    __slots__ = ("key", "path", "image", "image_digest", "cpus", "memory_mib", "size_bytes", "created_at", "bake_seconds", "smolfile_digest", "error", "machine_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    BAKE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MACHINE_IDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    path: str
    image: str
    image_digest: str
    cpus: int
    memory_mib: int
    size_bytes: int
    created_at: _timestamp_pb2.Timestamp
    bake_seconds: float
    smolfile_digest: str
    error: str
    machine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., path: _Optional[str] = ..., image: _Optional[str] = ..., image_digest: _Optional[str] = ..., cpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., bake_seconds: _Optional[float] = ..., smolfile_digest: _Optional[str] = ..., error: _Optional[str] = ..., machine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BakeImageRequest(_message.Message):
    __slots__ = ("smolfile", "replace")
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    smolfile: Smolfile
    replace: bool
    def __init__(self, smolfile: _Optional[_Union[Smolfile, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class BakeImageResponse(_message.Message):
    __slots__ = ("bake",)
    BAKE_FIELD_NUMBER: _ClassVar[int]
    bake: Bake
    def __init__(self, bake: _Optional[_Union[Bake, _Mapping]] = ...) -> None: ...

class ListBakesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBakesResponse(_message.Message):
    __slots__ = ("bakes",)
    BAKES_FIELD_NUMBER: _ClassVar[int]
    bakes: _containers.RepeatedCompositeFieldContainer[Bake]
    def __init__(self, bakes: _Optional[_Iterable[_Union[Bake, _Mapping]]] = ...) -> None: ...

class DeleteBakeRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteBakeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Image(_message.Message):
    __slots__ = ("names", "manifest_digest", "size_bytes", "created_at")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    manifest_digest: str
    size_bytes: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, names: _Optional[_Iterable[str]] = ..., manifest_digest: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PullImageRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: str
    def __init__(self, ref: _Optional[str] = ...) -> None: ...

class PullImageResponse(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: Image
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class RemoveImageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveImageResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, removed: _Optional[_Iterable[str]] = ...) -> None: ...

class PruneImagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PruneImagesResponse(_message.Message):
    __slots__ = ("removed", "freed_bytes")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedScalarFieldContainer[str]
    freed_bytes: int
    def __init__(self, removed: _Optional[_Iterable[str]] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class StoredResult(_message.Message):
    __slots__ = ("id", "kind", "state", "outcome", "outcome_detail", "labels", "created_at", "finished_at", "machine_id", "run", "verify")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_DETAIL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    state: ResultState
    outcome: Outcome
    outcome_detail: str
    labels: _containers.ScalarMap[str, str]
    created_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    machine_id: str
    run: RunResponse
    verify: VerifyResult
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[_Union[ResultState, str]] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., outcome_detail: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., machine_id: _Optional[str] = ..., run: _Optional[_Union[RunResponse, _Mapping]] = ..., verify: _Optional[_Union[VerifyResult, _Mapping]] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("name", "size_bytes", "sha256", "kept", "note")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    sha256: str
    kept: bool
    note: str
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., kept: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class GetArtifactRequest(_message.Message):
    __slots__ = ("result_id", "name")
    RESULT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    result_id: str
    name: str
    def __init__(self, result_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class GetArtifactResponse(_message.Message):
    __slots__ = ("content", "sha256")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    content: bytes
    sha256: str
    def __init__(self, content: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class PruneResultsRequest(_message.Message):
    __slots__ = ("older_than_seconds", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OLDER_THAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    older_than_seconds: float
    labels: _containers.ScalarMap[str, str]
    def __init__(self, older_than_seconds: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PruneResultsResponse(_message.Message):
    __slots__ = ("removed", "freed_bytes")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    removed: int
    freed_bytes: int
    def __init__(self, removed: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class GetResultRequest(_message.Message):
    __slots__ = ("id", "wait_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    wait_seconds: float
    def __init__(self, id: _Optional[str] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class GetResultResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: StoredResult
    def __init__(self, result: _Optional[_Union[StoredResult, _Mapping]] = ...) -> None: ...

class ListResultsRequest(_message.Message):
    __slots__ = ("labels", "kind", "limit")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    kind: str
    limit: int
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., kind: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListResultsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StoredResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StoredResult, _Mapping]]] = ...) -> None: ...

class GetDaemonInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDaemonInfoResponse(_message.Message):
    __slots__ = ("max_machines", "max_memory_mib", "max_cpus", "default_memory_mib", "live_machines", "memory_in_use_mib", "public_network")
    MAX_MACHINES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MAX_CPUS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    LIVE_MACHINES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_IN_USE_MIB_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_NETWORK_FIELD_NUMBER: _ClassVar[int]
    max_machines: int
    max_memory_mib: int
    max_cpus: int
    default_memory_mib: int
    live_machines: int
    memory_in_use_mib: int
    public_network: bool
    def __init__(self, max_machines: _Optional[int] = ..., max_memory_mib: _Optional[int] = ..., max_cpus: _Optional[int] = ..., default_memory_mib: _Optional[int] = ..., live_machines: _Optional[int] = ..., memory_in_use_mib: _Optional[int] = ..., public_network: _Optional[bool] = ...) -> None: ...
