//! One request and its state machine.
//!
//! ```text
//!   Waiting ──admit──▶ Prefilling{computed} ──last chunk──▶ Decoding{committed, bonus}
//!      ▲                    │                                   │
//!      └──── Preempted ◀────┴──────────── preempt ──────────────┘
//!   any live state ──abort / stop / length / error──▶ Finished(reason)
//! ```
//! `tokens` = prompt ++ output. In `Decoding`, the target KV (and, by construction, the
//! draft context: same slots, same pages) holds positions `[0, committed)` and
//! `tokens == [.. committed tokens .., bonus]`, i.e. `committed + 1 == tokens.len()`.
//! There is no draft-side length anywhere: the draft context *is* the committed prefix.

use crate::block_pool::PageList;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token (EOS or a `stop_token_ids` entry) or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Aborted by the client (or rejected mid-flight).
    Abort,
    /// An engine error while processing this request.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        Self::NAMES[self.code() as usize].expect("finished reasons have names")
    }

    /// Names by code (`code()` indexes this; 0 = still running).
    pub const NAMES: [Option<&'static str>; 5] = [None, Some("stop"), Some("length"), Some("abort"), Some("error")];

    pub fn from_code(code: u8) -> Option<FinishReason> {
        match code {
            1 => Some(FinishReason::Stop),
            2 => Some(FinishReason::Length),
            3 => Some(FinishReason::Abort),
            4 => Some(FinishReason::Error),
            _ => None,
        }
    }

    /// Compact code for numpy transport: 0 = not finished.
    pub fn code(self) -> u8 {
        match self {
            FinishReason::Stop => 1,
            FinishReason::Length => 2,
            FinishReason::Abort => 3,
            FinishReason::Error => 4,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Waiting,
    /// `computed` tokens have KV; the target of prefill is `Request::prefill_target()`.
    Prefilling { computed: usize },
    /// `committed` tokens have KV; `bonus` is the last sampled token, not yet in any KV.
    Decoding { committed: usize, bonus: u32 },
    /// Evicted by recompute: everything it held is freed; it will prefill its known tokens again.
    Preempted,
    Finished(FinishReason),
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Waiting => "waiting",
            Phase::Prefilling { .. } => "prefilling",
            Phase::Decoding { .. } => "decoding",
            Phase::Preempted => "preempted",
            Phase::Finished(_) => "finished",
        }
    }

    /// Waiting | Preempted -> Prefilling{0}.
    pub fn admit(self) -> Phase {
        match self {
            Phase::Waiting | Phase::Preempted => Phase::Prefilling { computed: 0 },
            other => panic!("admit from {}", other.name()),
        }
    }

    /// Prefilling | Decoding -> Preempted.
    pub fn preempt(self) -> Phase {
        match self {
            Phase::Prefilling { .. } | Phase::Decoding { .. } => Phase::Preempted,
            other => panic!("preempt from {}", other.name()),
        }
    }

    pub fn finish(self, reason: FinishReason) -> Phase {
        match self {
            Phase::Finished(_) => panic!("finish twice"),
            _ => Phase::Finished(reason),
        }
    }

    pub fn is_running(&self) -> bool {
        matches!(self, Phase::Prefilling { .. } | Phase::Decoding { .. })
    }
}

#[derive(Debug)]
pub struct Request {
    pub handle: u64,
    pub id: String,
    pub prompt_len: usize,
    /// prompt ++ output tokens.
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    /// EOS ids (unless ignore_eos) and the request's stop_token_ids.
    pub stop_token_ids: Vec<u32>,
    pub phase: Phase,
    pub pages: PageList,
    /// The step whose plan may commit to this request, if any.
    pub ticket: Option<u64>,
    pub num_preemptions: u32,
}

impl Request {
    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
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

    /// Append one sampled token; returns a finish reason if this token ends the request.
    pub fn push_token(&mut self, token: u32) -> Option<FinishReason> {
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

    #[test]
    fn finish_codes_round_trip() {
        for r in [FinishReason::Stop, FinishReason::Length, FinishReason::Abort, FinishReason::Error] {
            assert_eq!(FinishReason::from_code(r.code()), Some(r));
            assert_eq!(FinishReason::NAMES[r.code() as usize], Some(r.as_str()));
        }
        assert_eq!(FinishReason::from_code(0), None);
    }

    #[test]
    fn transitions_follow_the_diagram() {
        let p = Phase::Waiting.admit();
        assert_eq!(p, Phase::Prefilling { computed: 0 });
        let p = p.preempt();
        assert_eq!(p, Phase::Preempted);
        let p = p.admit();
        assert!(p.is_running());
        assert_eq!(p.finish(FinishReason::Abort), Phase::Finished(FinishReason::Abort));
    }

    #[test]
    #[should_panic(expected = "admit from decoding")]
    fn cannot_admit_a_decoding_request() {
        let _ = Phase::Decoding { committed: 3, bonus: 1 }.admit();
    }
}
