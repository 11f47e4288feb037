"""Pure data shared by every layer (no torch): sampling parameters and the
scheduler <-> runner contract. Sits below engine/ and runner/ so both may import it."""
from kvstrata.protocol.request_output import FinishReason, RequestOutput, SpecCounts
from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.protocol.scheduler_output import (
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    Event,
    Op,
    StorageCancel,
    StorageProgress,
    TopLogprob,
    TransferDone,
    TransferOp,
    TreeDraft,
    of_type,
)

__all__ = [
    "SamplingParams",
    "NewRequestData",
    "ScheduledRequest",
    "SchedulerOutput",
    "RunnerOutput",
    "FinishReason",
    "RequestOutput",
    "SpecCounts",
    "TopLogprob",
    "TransferOp",
    "TreeDraft",
    "StorageProgress",
    "StorageCancel",
    "TransferDone",
    "Op",
    "Event",
    "of_type",
]
