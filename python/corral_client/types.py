"""Typed values the client returns (plain dataclasses, not protobuf messages).

Times (`submitted_at`, `start`, ...) are corral TSO timestamps: milliseconds since the Unix
epoch shifted left by 18 bits, plus a logical counter; `tso_to_datetime` converts one.
"""

import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional

LOGICAL_BITS = 18

STATES = ("pending", "running", "succeeded", "failed", "cancelled", "preempted")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


def tso_to_datetime(ts):
    """The UTC time of a TSO timestamp."""
    return datetime.datetime.fromtimestamp((ts >> LOGICAL_BITS) / 1000, tz=datetime.timezone.utc)


def datetime_to_tso(when):
    """The first TSO timestamp of the millisecond `when` (a datetime; naive means UTC)."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return int(when.timestamp() * 1000) << LOGICAL_BITS


def _opt(msg, name):
    return getattr(msg, name) if msg.HasField(name) else None


@dataclass
class Job:
    id: int
    name: str
    tenant: str
    state: str
    priority: str
    gpus: int
    command: List[str]
    submitted_at: int
    started_at: Optional[int] = None
    finished_at: Optional[int] = None
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    reason: Optional[str] = None
    # The node of the (first part of the) allocation, and the GPU indices there.
    node: Optional[str] = None
    gpu_indices: List[int] = field(default_factory=list)
    # Every node of the allocation (a gang has several).
    nodes: List[str] = field(default_factory=list)
    time_limit_secs: Optional[int] = None
    cpus: float = 0.0
    memory_bytes: int = 0
    image: Optional[str] = None
    attempts: int = 0
    restarts: int = 0
    held: bool = False
    cancel_requested: bool = False
    # "12_7" for task 7 of array 12.
    array_task: Optional[str] = None

    @property
    def done(self):
        """The job ended (succeeded, failed or cancelled)."""
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self):
        return self.state == "succeeded"


@dataclass
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mib: int
    # idle | allocated | dirty | unhealthy | unavailable | unknown
    state: str
    temperature_c: int = 0
    utilization_percent: int = 0
    memory_used_mib: int = 0
    job_ids: List[int] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)


@dataclass
class Node:
    name: str
    address: str
    # up | cordoned | draining | drained | down
    state: str
    gpus: List[Gpu]
    cpus: float = 0.0
    memory_bytes: int = 0
    labels: Dict[str, str] = field(default_factory=dict)
    reason: str = ""
    running_jobs: int = 0
    heartbeat_age_ms: Optional[int] = None
    # Every partition the node is in, in the worker's order (`labels` holds only one of them).
    partitions: List[str] = field(default_factory=list)


@dataclass
class Segment:
    """One priced run of a job in the billing ledger."""

    id: int
    job_id: int
    tenant: str
    node: str
    gpu_model: str
    gpus: int
    priority: str
    start: int
    end: int
    duration_ms: int
    # Integer micro-units of the cluster's currency.
    cost_micros: int
    end_state: str
    lost: bool = False
    policy_version: int = 0

    @property
    def cost(self):
        return self.cost_micros / 1_000_000


@dataclass
class JobEvent:
    """A job as of `revision` (the applied log index of its latest change)."""

    revision: int
    job: Job


def job_from_pb(j, pb):
    state = pb.JobState.Name(j.state)[len("JOB_STATE_"):].lower()
    alloc = j.allocation if j.HasField("allocation") else None
    nodes = []
    if alloc is not None:
        nodes = [alloc.node] + [n.node for n in alloc.more_nodes]
    array_task = f"{j.array_task.array}_{j.array_task.index}" if j.HasField("array_task") else None
    return Job(
        id=j.id,
        name=j.spec.name,
        tenant=j.spec.tenant,
        state=state,
        priority=j.spec.priority_class,
        gpus=j.spec.gpus,
        command=list(j.spec.command),
        submitted_at=j.submitted_at,
        started_at=_opt(j, "started_at"),
        finished_at=_opt(j, "finished_at"),
        exit_code=_opt(j, "exit_code"),
        signal=_opt(j, "signal"),
        reason=_opt(j, "reason"),
        node=alloc.node if alloc is not None else None,
        gpu_indices=list(alloc.gpus) if alloc is not None else [],
        nodes=nodes,
        time_limit_secs=_opt(j.spec, "time_limit_secs"),
        cpus=j.spec.cpu_millis / 1000,
        memory_bytes=j.spec.memory_bytes,
        image=_opt(j.spec, "image"),
        attempts=j.attempts,
        restarts=j.restarts,
        held=j.held,
        cancel_requested=j.cancel_requested,
        array_task=array_task,
    )


def node_from_pb(n):
    gpus = [
        Gpu(
            index=g.index,
            uuid=g.uuid,
            model=g.model,
            memory_mib=g.memory_mib,
            state=g.state,
            temperature_c=g.temperature_c,
            utilization_percent=g.utilization_percent,
            memory_used_mib=g.memory_used_mib,
            job_ids=list(g.job_ids),
            problems=list(g.problems),
        )
        for g in n.gpus
    ]
    return Node(
        name=n.name,
        address=n.address,
        state=n.state,
        gpus=gpus,
        cpus=n.cpu_millis / 1000,
        memory_bytes=n.memory_bytes,
        labels=dict(n.labels),
        reason=n.reason,
        running_jobs=n.running_jobs,
        heartbeat_age_ms=_opt(n, "heartbeat_age_ms"),
        partitions=list(n.partitions),
    )


def segment_from_pb(s):
    duration = s.duration_ms if s.HasField("duration_ms") else max(0, (s.end - s.start) >> LOGICAL_BITS)
    return Segment(
        id=s.id,
        job_id=s.job_id,
        tenant=s.tenant,
        node=s.node,
        gpu_model=s.gpu_model,
        gpus=s.gpus,
        priority=s.priority_class,
        start=s.start,
        end=s.end,
        duration_ms=duration,
        cost_micros=s.cost_micros,
        end_state=s.end_state,
        lost=s.lost,
        policy_version=s.policy_version,
    )
