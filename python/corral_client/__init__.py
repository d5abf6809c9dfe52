"""Python client of corral, the GPU-pool scheduler.

    from corral_client import Client
    c = Client("127.0.0.1:7070")
    job = c.wait(c.submit(["python", "train.py"], gpus=1))
"""

from .client import Client
from .errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    CorralError,
    DeadlineExceeded,
    InvalidJob,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RevisionTooOld,
    ServerError,
    TlsRefused,
    Unauthenticated,
    Unavailable,
)
from .types import Gpu, Job, JobEvent, Node, Segment, tso_to_datetime

__all__ = [
    "Client",
    "Job",
    "Node",
    "Gpu",
    "Segment",
    "JobEvent",
    "tso_to_datetime",
    "CorralError",
    "InvalidJob",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "Unauthenticated",
    "ResourceExhausted",
    "Unavailable",
    "TlsRefused",
    "DeadlineExceeded",
    "Cancelled",
    "Aborted",
    "RevisionTooOld",
    "ServerError",
]
