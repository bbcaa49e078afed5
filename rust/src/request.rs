//! One request and its state machine.
//!
//! ```text
//!   Waiting ──admit──▶ Prefilling{computed} ──last chunk──▶ Decoding
//!      ▲                    │                                   │
//!      └──── Preempted ◀────┴──────────── preempt ──────────────┘
//!   any live state ──abort / stop / length / error──▶ Finished(reason)
//! ```
//! `tokens` = prompt ++ output. In `Decoding`, the target KV (and, by construction, the
//! draft context: same slots, same pages) holds positions `[0, committed)` where
//! `committed == tokens.len() - 1`, and the bonus token is `tokens[committed]`: both are
//! read off `tokens`, never stored beside it. There is no draft-side length anywhere: the
//! draft context *is* the committed prefix.
//!
//! Fields are private: the phase changes only through the transitions below, each of which
//! keeps the invariants above (the scheduler decides *when*, the request *how*).
//!
//! Prefix caching: the leading pages of the page list may be *frozen*: cache hits shared at
//! admission, and pages published after a commit once the computed prefix covers them (the
//! target KV and the draft context of every position in them are written by then: both are
//! written in the step that computes the position). `frozen[j]` is the cache entry that names
//! the content of page `j` (its own publication, or an equal page published first). Frozen
//! pages lie inside the computed prefix and no step writes them again; every other page is
//! private to this request.
//!
//! Recurrent state (hybrid targets, `SchedulerConfig::state_slots`): a request also owns
//! *state slots*, pages of the same pool, each holding a whole recurrent state (every GDN
//! layer's conv window and state). `committed_slot` is the slot whose state covers exactly
//! the computed prefix (`num_computed()` tokens); `None` while nothing is computed (fresh, or
//! resumed after preemption: the state was freed and prefill recomputes from scratch). A step
//! reads the committed slot and writes only the *other* slots (`state_writes`), so a
//! cancelled or failed step leaves the committed state intact; applying a step moves
//! `committed_slot` to the slot of the last kept row: an index update, never a copy.

use crate::page_pool::{EntryId, PageId, PageList, Publish, ROOT_ENTRY};

/// Why a request finished. The discriminant is the code handed to Python (0 = running).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FinishReason {
    /// A stop token (EOS or a `stop_token_ids` entry) or a stop string.
    Stop = 1,
    /// `max_tokens` reached.
    Length = 2,
    /// Aborted by the client (or rejected mid-flight).
    Abort = 3,
    /// An engine error while processing this request.
    Error = 4,
}

impl FinishReason {
    pub const ALL: [FinishReason; 4] =
        [FinishReason::Stop, FinishReason::Length, FinishReason::Abort, FinishReason::Error];

    /// Names by code (`code()` indexes this; 0 = still running).
    pub const NAMES: [Option<&'static str>; 5] = [None, Some("stop"), Some("length"), Some("abort"), Some("error")];

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn as_str(self) -> &'static str {
        Self::NAMES[self.code() as usize].expect("finished reasons have names")
    }

    pub fn from_code(code: u8) -> Option<FinishReason> {
        Self::ALL.into_iter().find(|r| r.code() == code)
    }

    pub fn from_name(name: &str) -> Option<FinishReason> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Waiting,
    /// `computed` tokens have KV; the target of prefill is `Request::prefill_target()`.
    Prefilling {
        computed: usize,
    },
    /// `tokens.len() - 1` tokens have KV; the last token is the bonus, not yet in any KV.
    Decoding,
    /// Evicted by recompute: everything it held is freed; it will prefill its known tokens again.
    Preempted,
    Finished(FinishReason),
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Waiting => "waiting",
            Phase::Prefilling { .. } => "prefilling",
            Phase::Decoding => "decoding",
            Phase::Preempted => "preempted",
            Phase::Finished(_) => "finished",
        }
    }

    pub fn is_running(&self) -> bool {
        matches!(self, Phase::Prefilling { .. } | Phase::Decoding)
    }
}

/// What applying one step's results did to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Tokens appended to the output by this step.
    pub new_tokens: usize,
    pub finish: Option<FinishReason>,
}

#[derive(Debug)]
pub struct Request {
    id: String,
    prompt_len: usize,
    /// prompt ++ output tokens.
    tokens: Vec<u32>,
    max_tokens: usize,
    /// EOS ids (unless ignore_eos) and the request's stop_token_ids.
    stop_token_ids: Vec<u32>,
    phase: Phase,
    pages: PageList,
    /// Chained hashes of the full pages of `tokens` hashed so far (tokens never change, so
    /// neither do these).
    page_hashes: Vec<u64>,
    /// Cache entries of the leading frozen pages (module doc).
    frozen: Vec<EntryId>,
    /// A page could not be published (another page holds its hash): no later page can be.
    publish_stopped: bool,
    /// Prompt tokens served from the cache at the first admission.
    num_cached_tokens: Option<usize>,
    /// State slots (hybrid targets; module doc), pages of the same pool as `pages`.
    state: PageList,
    /// The slot holding the state of the computed prefix (one of `state`), if any.
    committed_slot: Option<PageId>,
}

impl Request {
    pub(crate) fn new(id: &str, prompt: &[u32], max_tokens: usize, stop_token_ids: Vec<u32>, pages: PageList) -> Self {
        let mut tokens = Vec::with_capacity(prompt.len() + max_tokens);
        tokens.extend_from_slice(prompt);
        let state = pages.pool().empty_list();
        Request {
            id: id.to_string(),
            prompt_len: prompt.len(),
            tokens,
            max_tokens,
            stop_token_ids,
            phase: Phase::Waiting,
            pages,
            page_hashes: Vec::new(),
            frozen: Vec::new(),
            publish_stopped: false,
            num_cached_tokens: None,
            state,
            committed_slot: None,
        }
    }

    /// State slots owned (hybrid targets; empty otherwise).
    pub fn state_slots(&self) -> &[PageId] {
        self.state.pages()
    }

    /// The slot whose state covers the computed prefix (None: no state yet, read as zeros).
    pub fn committed_slot(&self) -> Option<PageId> {
        self.committed_slot
    }

    /// The first `n` owned slots other than the committed one: where a step writes the
    /// states it keeps (row t of a verify block -> slot t; a prefill chunk's last row -> 0).
    pub(crate) fn state_writes(&self, n: usize) -> Vec<PageId> {
        let w: Vec<PageId> =
            self.state.pages().iter().copied().filter(|&p| Some(p) != self.committed_slot).take(n).collect();
        assert_eq!(w.len(), n, "request {}: {} state slots cannot take {n} writes", self.id, self.state.len());
        w
    }

    /// A step's kept row wrote `slot` (one of `state_writes`): its state is now the
    /// committed one (an index update; the previous committed slot becomes a spare).
    pub(crate) fn commit_state(&mut self, slot: PageId) {
        assert!(
            self.state.pages().contains(&slot),
            "request {}: committing state slot {slot} it does not own",
            self.id
        );
        self.committed_slot = Some(slot);
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn pages(&self) -> &PageList {
        &self.pages
    }

    /// Leading pages that are frozen (shared from the cache or published); no step writes them.
    pub fn num_frozen_pages(&self) -> usize {
        self.frozen.len()
    }

    /// Cache entries of the frozen pages.
    pub fn frozen_entries(&self) -> &[EntryId] {
        &self.frozen
    }

    /// Prompt tokens whose KV came from the prefix cache at the first admission (0 before).
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens.unwrap_or(0)
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose KV exists: `computed` while prefilling, `committed` while decoding.
    pub fn num_computed(&self) -> usize {
        match self.phase {
            Phase::Prefilling { computed } => computed,
            Phase::Decoding => self.tokens.len() - 1,
            _ => 0,
        }
    }

    /// How many tokens prefill must bring into KV, and whether its last row is sampled.
    /// A fresh request prefills its prompt and samples the first token; a request resumed
    /// after preemption already knows its bonus token and recomputes everything before it.
    pub fn prefill_target(&self) -> (usize, bool) {
        if self.num_output() == 0 {
            (self.prompt_len, true)
        } else {
            (self.tokens.len() - 1, false)
        }
    }

    /// Grow to `pages` KV pages and `slots` state slots, from the one pool; all or nothing.
    pub(crate) fn grow(&mut self, pages: usize, slots: usize) -> bool {
        let want = pages.saturating_sub(self.pages.len()) + slots.saturating_sub(self.state.len());
        if want > self.pages.pool().num_free() {
            return false;
        }
        let grown = self.pages.grow_to(pages) && self.state.grow_to(slots);
        assert!(grown, "checked above");
        true
    }

    /// Hash the full pages of `tokens` up to `n` pages (at most the full pages there are).
    fn hash_pages(&mut self, n: usize) {
        let ps = self.pages.pool().page_size();
        let n = n.min(self.tokens.len() / ps);
        while self.page_hashes.len() < n {
            let j = self.page_hashes.len();
            let parent = self.page_hashes.last().copied().unwrap_or(0);
            let h = self.pages.pool().page_hash(parent, &self.tokens[j * ps..(j + 1) * ps]);
            self.page_hashes.push(h);
        }
    }

    /// The cached pages a (re-)admission can share: the longest published run equal to the
    /// leading full pages of what prefill must compute, short of its last token (at least one
    /// token is always computed; when the target ends on a page boundary, its last page is
    /// recomputed). Changes nothing but the memoised hashes.
    pub(crate) fn cache_lookup(&mut self) -> Vec<(PageId, EntryId)> {
        assert!(matches!(self.phase, Phase::Waiting | Phase::Preempted), "lookup from {}", self.phase.name());
        let (target, _) = self.prefill_target();
        let max_pages = (target - 1) / self.pages.pool().page_size();
        self.hash_pages(max_pages);
        self.pages.pool().match_prefix(&self.page_hashes[..max_pages], &self.tokens)
    }

    /// Waiting | Preempted -> Prefilling{computed: hits * page_size}: share the cache hits
    /// (`cache_lookup`, or none), grow to `n` pages and take `slots` state slots (hybrid
    /// targets: no cache hits, since a cached prefix carries no state). All or nothing: false
    /// if the pool is short, and then nothing changed.
    pub(crate) fn admit(&mut self, hits: &[(PageId, EntryId)], n: usize, slots: usize) -> bool {
        assert!(matches!(self.phase, Phase::Waiting | Phase::Preempted), "admit from {}", self.phase.name());
        assert!(slots == 0 || hits.is_empty(), "a request with state slots cannot start from cached pages");
        assert!(self.state.is_empty() && self.committed_slot.is_none(), "a queued request holds no state");
        if slots > 0 && n + slots > self.pages.pool().num_free() {
            return false;
        }
        let shared: Vec<PageId> = hits.iter().map(|h| h.0).collect();
        if !self.pages.acquire_prefix(&shared, n) {
            return false;
        }
        let taken = self.state.grow_to(slots);
        assert!(taken, "checked above");
        let computed = hits.len() * self.pages.pool().page_size();
        assert!(computed < self.prefill_target().0, "a cache hit must leave a token to compute");
        self.frozen = hits.iter().map(|h| h.1).collect();
        self.num_cached_tokens.get_or_insert(computed);
        self.phase = Phase::Prefilling { computed };
        true
    }

    /// Publish the full pages the computed prefix now covers (after a commit): their target
    /// KV and draft context are written and no step writes them again.
    pub(crate) fn publish_computed(&mut self) {
        let ps = self.pages.pool().page_size();
        let full = self.num_computed() / ps;
        if self.publish_stopped || full <= self.frozen.len() {
            return;
        }
        self.hash_pages(full);
        for j in self.frozen.len()..full {
            let parent = self.frozen.last().copied().unwrap_or(ROOT_ENTRY);
            let toks = &self.tokens[j * ps..(j + 1) * ps];
            match self.pages.pool().publish(self.pages.pages()[j], self.page_hashes[j], parent, toks) {
                Publish::Published(e) | Publish::Duplicate(e) => self.frozen.push(e),
                Publish::Conflict => {
                    self.publish_stopped = true;
                    return;
                }
            }
        }
    }

    /// Prefilling | Decoding -> Preempted; every page goes back to the pool (published ones
    /// stay cached on the free list).
    pub(crate) fn preempt(&mut self) {
        assert!(self.phase.is_running(), "preempt from {}", self.phase.name());
        self.phase = Phase::Preempted;
        self.release_pages();
    }

    /// Any live state -> Finished; every page goes back to the pool.
    pub(crate) fn finish(&mut self, reason: FinishReason) {
        assert!(!matches!(self.phase, Phase::Finished(_)), "finish twice");
        self.phase = Phase::Finished(reason);
        self.release_pages();
    }

    fn release_pages(&mut self) {
        self.frozen.clear();
        self.publish_stopped = false;
        self.pages.clear();
        self.state.clear();
        self.committed_slot = None;
    }

    /// A prefill chunk of `len` rows from `start` ran. On the last chunk the request starts
    /// decoding: with the sampled first token, or (resumed) with its known bonus token.
    pub(crate) fn finish_prefill_chunk(&mut self, start: usize, len: usize, sampled: Option<u32>) -> Applied {
        assert_eq!(self.phase, Phase::Prefilling { computed: start }, "prefill chunk out of order");
        let (target, _) = self.prefill_target();
        let computed = start + len;
        if computed < target {
            self.phase = Phase::Prefilling { computed };
            return Applied { new_tokens: 0, finish: None };
        }
        self.phase = Phase::Decoding;
        match sampled {
            Some(tok) => Applied { new_tokens: 1, finish: self.push_token(tok) },
            None => Applied { new_tokens: 0, finish: None },
        }
    }

    /// A verify block ran at `committed`: commit `bonus, d_1..d_a`. The target's samples
    /// `t_0..t_a` are those tokens' successors, so the output grows by `t_0..t_a` (cut at
    /// a stop) and `t_a` is the new bonus.
    pub(crate) fn apply_verify(&mut self, committed: usize, samples: &[u32]) -> Applied {
        assert!(self.phase == Phase::Decoding && self.tokens.len() == committed + 1, "verify of a stale block");
        let mut applied = Applied { new_tokens: 0, finish: None };
        for &tok in samples {
            applied.new_tokens += 1;
            applied.finish = self.push_token(tok);
            if applied.finish.is_some() {
                break;
            }
        }
        applied
    }

    /// Append one sampled token; returns a finish reason if this token ends the request.
    fn push_token(&mut self, token: u32) -> Option<FinishReason> {
        self.tokens.push(token);
        if self.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.num_output() >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_pool::PagePool;

    fn req(pool: &PagePool) -> Request {
        Request::new("r", &[1, 2, 3], 4, vec![9], pool.empty_list())
    }

    #[test]
    fn finish_codes_round_trip() {
        for r in FinishReason::ALL {
            assert_eq!(FinishReason::from_code(r.code()), Some(r));
            assert_eq!(FinishReason::from_name(r.as_str()), Some(r));
            assert_eq!(FinishReason::NAMES[r.code() as usize], Some(r.as_str()));
        }
        assert_eq!(FinishReason::from_code(0), None);
        assert_eq!(FinishReason::from_name("running"), None);
    }

    #[test]
    fn transitions_follow_the_diagram() {
        let pool = PagePool::new(8, 4);
        let mut r = req(&pool);
        assert!(r.admit(&[], 0, 0));
        assert_eq!(r.phase(), Phase::Prefilling { computed: 0 });
        assert!(r.grow(1, 0));
        r.preempt();
        assert_eq!(r.phase(), Phase::Preempted);
        assert!(r.pages().is_empty(), "preemption frees the pages");
        assert!(r.admit(&[], 1, 0));
        assert_eq!(r.finish_prefill_chunk(0, 2, None), Applied { new_tokens: 0, finish: None });
        assert_eq!(r.finish_prefill_chunk(2, 1, Some(5)), Applied { new_tokens: 1, finish: None });
        assert_eq!((r.phase(), r.num_computed(), r.tokens()), (Phase::Decoding, 3, &[1, 2, 3, 5][..]));
        // bonus 5 at 3, accepted 1 draft: t_0, t_1 appended; the stop token 9 cuts the block.
        assert_eq!(r.apply_verify(3, &[6, 9, 7]), Applied { new_tokens: 2, finish: Some(FinishReason::Stop) });
        r.finish(FinishReason::Stop);
        assert_eq!(r.phase(), Phase::Finished(FinishReason::Stop));
    }

    #[test]
    #[should_panic(expected = "admit from decoding")]
    fn cannot_admit_a_decoding_request() {
        let pool = PagePool::new(8, 4);
        let mut r = req(&pool);
        r.admit(&[], 1, 0);
        r.finish_prefill_chunk(0, 3, Some(4));
        r.admit(&[], 1, 0);
    }

    #[test]
    #[should_panic(expected = "verify of a stale block")]
    fn verify_must_match_the_committed_count() {
        let pool = PagePool::new(8, 4);
        let mut r = req(&pool);
        r.admit(&[], 1, 0);
        r.finish_prefill_chunk(0, 3, Some(4));
        r.apply_verify(2, &[1]);
    }
}
