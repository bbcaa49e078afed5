"""Type stubs for the Rust core (rust/src/python.rs)."""

from typing import Sequence

import numpy as np
import numpy.typing as npt

NULL_PAGE: int
FINISH_REASONS: list[str | None]  # indexed by CommitResult.finish_codes

class CoreError(Exception): ...
class InvalidConfigError(CoreError): ...

class RequestRejectedError(CoreError, ValueError):
    """The request can never be served; `param` names the offending parameter."""

    param: str | None

class DuplicateRequestError(CoreError): ...
class UnknownRequestError(CoreError): ...
class PlanOutstandingError(CoreError): ...
class StalePlanError(CoreError): ...
class InvalidCommitError(CoreError): ...

_Ints = npt.NDArray[np.int64] | Sequence[int]

def draft_len_for(schedule: list[tuple[int, int]], k_max: int, num_decoding: int) -> int: ...
def pages_per_seq(max_model_len: int, num_speculative_tokens: int, page_size: int) -> int: ...

class StepPlan:
    """One step's read-only arrays; carries the move-only ticket that `commit` spends."""

    step_id: int
    block_rows: int
    num_decode: int
    num_rows: int
    handles: npt.NDArray[np.uint64]
    num_drafts: npt.NDArray[np.int64]
    sample_start: npt.NDArray[np.int64]  # R+1 offsets into sample_rows
    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    page_tables: npt.NDArray[np.int32]
    sample_rows: npt.NDArray[np.int64]
    draft_input_ids: npt.NDArray[np.int64]
    draft_positions: npt.NDArray[np.int64]
    draft_slot_mapping: npt.NDArray[np.int64]
    draft_query_start_loc: npt.NDArray[np.int32]
    draft_seq_lens: npt.NDArray[np.int32]
    draft_page_tables: npt.NDArray[np.int32]
    verify_target_rows: npt.NDArray[np.int64]
    def __len__(self) -> int: ...

class CommitResult:
    handles: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.int64]
    new_tokens: npt.NDArray[np.int64]
    finish_codes: npt.NDArray[np.uint8]
    num_cached_tokens: npt.NDArray[np.uint32]  # per request: prompt tokens taken from the prefix cache
    def __len__(self) -> int: ...
    def items(self) -> list[tuple[int, list[int], str | None]]: ...

class Scheduler:
    num_running: int
    num_waiting: int
    num_live: int
    num_free_pages: int
    num_usable_pages: int
    kv_usage: float
    num_preemptions: int
    enable_prefix_caching: bool
    prefix_cache_queries: int  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from the cache
    num_cached_pages: int  # published pages, in use or free
    page_size: int
    block_rows: int
    outstanding_step: int | None
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        mask_token_id: int = 0,
        enable_prefix_caching: bool = True,
        draft_len_schedule: list[tuple[int, int]] = [],
        draft_block_rows: int = 0,  # D: the draft's block (KV reserved for max(B, D) rows)
    ) -> None: ...
    def add_request(
        self, request_id: str, prompt_token_ids: _Ints, max_tokens: int, stop_token_ids: _Ints | None = None
    ) -> int: ...
    def handle_of(self, request_id: str) -> int | None: ...
    def abort(self, handle: int) -> None: ...
    def finish(self, handle: int, reason: str) -> None: ...
    def schedule(self) -> StepPlan | None: ...
    def schedule_only(self, handle: int) -> StepPlan | None: ...
    def commit(self, plan: StepPlan, accepted: _Ints, sampled: _Ints) -> CommitResult: ...
    def cancel(self, plan: StepPlan) -> None: ...
    def fail(self, plan: StepPlan, reason: str = "error") -> list[int]: ...
    def request_state(self, handle: int) -> tuple[str, int, list[int]]: ...
    def num_cached_tokens(self, handle: int) -> int: ...
    def request_pages(self, handle: int) -> list[int]: ...
    def check_invariants(self) -> None: ...
