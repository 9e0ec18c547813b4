"""Wire records and subject names shared by every AIKG service and client."""

from schemas import subjects
from schemas.events import (
    ALL_RECORDS,
    MAX_SOURCE_BYTES,
    SCHEMA_VERSION,
    TERMINAL_STATUSES,
    JobEvent,
    JobProgress,
    JobRecord,
    JobResult,
    JobSubmit,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
    decode,
    encode,
    new_id,
    normalize_dsl,
    utcnow,
)

__all__ = [
    "ALL_RECORDS",
    "MAX_SOURCE_BYTES",
    "SCHEMA_VERSION",
    "TERMINAL_STATUSES",
    "JobEvent",
    "JobProgress",
    "JobRecord",
    "JobResult",
    "JobSubmit",
    "VerifyRequest",
    "VerifyResult",
    "WorkerInfo",
    "decode",
    "encode",
    "new_id",
    "normalize_dsl",
    "subjects",
]
