//! Typed errors of the core. Every misuse returns one of these and changes nothing.

use std::fmt;

/// The request parameter a rejection is about, named as the OpenAI API names it, so the
/// server can put it in its 400 without re-deriving the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    Prompt,
    MaxTokens,
    StopTokenIds,
}

impl Param {
    pub fn as_str(self) -> &'static str {
        match self {
            Param::Prompt => "prompt",
            Param::MaxTokens => "max_tokens",
            Param::StopTokenIds => "stop_token_ids",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    InvalidConfig(String),
    /// The request can never be served (too long for the model or the pool, bad input).
    Rejected {
        request_id: String,
        param: Param,
        reason: String,
    },
    DuplicateRequest(String),
    UnknownRequest(String),
    /// `schedule()` while the previous plan is neither committed nor cancelled.
    PlanOutstanding {
        step_id: u64,
    },
    /// A plan that is not the outstanding one, or whose requests were aborted or preempted.
    StalePlan(String),
    /// Results that do not fit the plan (wrong lengths, more accepted than proposed).
    InvalidCommit(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidConfig(m) => write!(f, "invalid scheduler config: {m}"),
            CoreError::Rejected { request_id, reason, .. } => {
                write!(f, "request {request_id:?} rejected: {reason}")
            }
            CoreError::DuplicateRequest(id) => write!(f, "request id {id:?} is already in use"),
            CoreError::UnknownRequest(id) => write!(f, "unknown request {id}"),
            CoreError::PlanOutstanding { step_id } => {
                write!(f, "plan of step {step_id} is still outstanding: commit or cancel it before scheduling again")
            }
            CoreError::StalePlan(m) => write!(f, "stale plan: {m}"),
            CoreError::InvalidCommit(m) => write!(f, "invalid commit: {m}"),
        }
    }
}

impl std::error::Error for CoreError {}

pub type CoreResult<T> = Result<T, CoreError>;
