"""Type stubs for the Rust core (rust/src/python.rs)."""

from collections.abc import Sequence

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
def pages_per_seq(max_model_len: int, reserve_rows: int, page_size: int) -> int:
    """Pages a request of max_model_len tokens holds at most; reserve_rows = max(B, D)."""

def state_slots_per_seq(num_speculative_tokens: int) -> int:
    """State slots a decoding request of a hybrid target holds: the committed one + one per verify row."""

def draft_pass_rows(block_rows: int, draft_block_rows: int) -> int:
    """D of a step verifying block_rows rows: max(B, the draft's block), 0 when B = 1."""

def profile_plan(num_tokens: int, max_num_seqs: int, block_rows: int, draft_block_rows: int, reserve_rows: int,
                 max_model_len: int, page_size: int, mask_token_id: int, state_slots: bool = False) -> StepPlan:
    """The largest eager step, over a 2-page KV cache (no ticket: it is never committed);
    state_slots: with a hybrid target's state arrays (no state read, kept states in slot 1)."""

def mixed_prefill_tokens(query_start_loc: npt.NDArray[np.int32], sample_start: npt.NDArray[np.int64],
                         sample_rows: npt.NDArray[np.int64], num_decode: int, block_rows: int,
                         max_prefill_requests: int) -> int | None:
    """The prefill tokens of a plan a mixed-step graph can replay, or None (rust/src/staging.rs)."""

def stage_mixed_rows(srows: npt.NDArray[np.int64], vrows: npt.NDArray[np.int64],
                     query_start_loc: npt.NDArray[np.int32], sample_start: npt.NDArray[np.int64],
                     num_decode: int, bs: int, block_rows: int) -> npt.NDArray[np.int64]:
    """A mixed plan's sample and verify rows in bucket `bs`'s slots; -> each sample row's slot."""

def stage_sampling(int_fields: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]],
                   float_fields: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], float]],
                   sample_start: npt.NDArray[np.int64], mixed: tuple[int, int] | None = None) -> None:
    """Per-request values into their sample slots: (dst, values, pad) each; checks all first."""

def stage_arrays(dst: npt.NDArray[np.int64],
                 fields: list[tuple[str, npt.NDArray[np.int64] | npt.NDArray[np.int32], int, int, int | None]],
                 pages: tuple[npt.NDArray[np.int32], int, int, int, int] | None = None) -> None:
    """StepPlan.stage_into over arrays held in Python (a worker's WirePlan): (name, array, at,
    total, pad); pages: (tables, at, width, rows before, columns before)."""

class StepPlan:
    """One step's read-only arrays (made on first read); carries the move-only ticket that
    `commit` spends."""

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
    max_pages: int  # page_tables' columns
    sample_rows: npt.NDArray[np.int64]
    verify_target_rows: npt.NDArray[np.int64]  # rows 1..B-1 of each verify block: where drafts go
    # The draft pass: num_decode blocks of D = draft_rows rows (0: none this step), plan.rs.
    draft_rows: int
    draft_input_ids: npt.NDArray[np.int64]  # [bonus, MASK x (D-1)] per block
    draft_positions: npt.NDArray[np.int64]
    draft_slot_mapping: npt.NDArray[np.int64]
    draft_query_start_loc: npt.NDArray[np.int32]
    draft_seq_lens: npt.NDArray[np.int32]
    draft_page_tables: npt.NDArray[np.int32]  # page_tables[:num_decode]
    draft_proposal_rows: npt.NDArray[np.int64]  # rows 1..B-1 of each draft block: the K proposals
    # Hybrid targets (else empty): [R] committed state slot per request (-1: none, zeros) and
    # [T] the slot keeping the state after each target row (-1: not kept).
    state_read: npt.NDArray[np.int64]
    state_write: npt.NDArray[np.int64]
    def __len__(self) -> int: ...
    def stage_into(self, dst: npt.NDArray[np.int64], fields: list[tuple[str, int, int, int | None]],
                   pages: tuple[int, int, int, int] | None = None) -> None:
        """Copy the named 1-D arrays into `dst`: (name, at, total, pad); pad None: the last value.
        pages: (at, width, rows before, columns before): the page tables as rows of `width`."""

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
    state_slots_per_seq: int  # state slots a decoding request holds (0 without state slots)
    outstanding_step: int | None
    draft_len_policy: str  # "fixed", "schedule" or "adaptive"
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
        # Each step's K (rust/src/draft_len.rs): "fixed" (num_speculative_tokens; a non-empty
        # draft_len_schedule makes it "schedule"), "schedule", or "adaptive": the candidate k
        # (default: every k in 0..=num_speculative_tokens) with the most expected committed
        # tokens per second once set_step_costs was called. Bad names/combinations: ValueError.
        draft_len_policy: str = "fixed",
        draft_len_candidates: list[int] = [],
        # A hybrid target: each running request also holds recurrent-state slots, pages of the
        # same pool (2 while prefilling, K + 2 while decoding); excludes prefix caching.
        state_slots: bool = False,
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
    def state_slots(self, handle: int) -> tuple[int, list[int]]:
        """(committed state slot or -1, owned state slots) of a live request (hybrid targets)."""
    def set_step_costs(self, buckets: list[int], ks: list[int], seconds: list[list[float]]) -> None:
        """Measured seconds of a decode step, seconds[i][j] for a batch padded to buckets[i]
        (ascending) drafting ks[j] (ascending; 0 = plain decode); ValueError if malformed."""
    def draft_len_counts(self) -> dict[int, int]:
        """Planned steps with decoding requests, by the k they drafted (every choosable k)."""
    def acceptance_calibration(self) -> list[float]:
        """c_1..c_K: per draft position, observed over predicted acceptances (decayed)."""
    def acceptance_estimates(self) -> list[float]:
        """Global p_1..p_K: P(draft j accepted | drafts 1..j-1 were), decayed."""
    def next_draft_len(self) -> int: ...
    def check_invariants(self) -> None: ...
