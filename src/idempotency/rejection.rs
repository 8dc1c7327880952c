//! The one place where the proxy's own answers become HTTP responses.
//!
//! Every error the proxy produces is an RFC 9457 `application/problem+json`
//! document with `type`, `title`, `status`, `detail` and, where known, the
//! key's state. Retry hints are explicit because real SDKs (stripe-python,
//! the OpenAI and Anthropic SDKs) retry any 409 unless told not to and retry a
//! 425 only when told to: `x-should-retry` and `Stripe-Should-Retry` say which.

use std::time::Duration;

use axum::body::Body;
use http::header::RETRY_AFTER;
use http::{HeaderValue, Response, StatusCode};

use super::policy::Profile;
use crate::core::{KeyState, UnknownCause};
use crate::http::headers::{RETRY_AFTER_MS, STRIPE_SHOULD_RETRY, X_SHOULD_RETRY};
use crate::http::Problem;
use crate::request::key::InvalidKey;

/// Why the proxy answered by itself instead of with the upstream's response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// A covered request without a key on a route that requires one.
    MissingKey,
    InvalidKey(InvalidKey),
    BodyTooLarge {
        limit: usize,
    },
    /// The request body could not be read (the client went away mid-body).
    BodyUnreadable,
    /// The key is read from the body (`at`, a `json:` source or
    /// attribute) and the body is not JSON the proxy can parse.
    InvalidBody {
        at: String,
    },
    /// The request body did not arrive whole within `request_body_timeout`.
    BodyTimeout {
        timeout: Duration,
    },
    /// The key belongs to a different request.
    KeyReused {
        state: KeyState,
    },
    /// The same request is still running.
    InFlight {
        retry_after: Duration,
    },
    StoreUnavailable {
        retry_after: Duration,
    },
    /// `max_in_flight` requests are already being served; this one was
    /// turned away before anything was read, claimed or sent.
    Overloaded {
        retry_after: Duration,
    },
    /// The upstream could not be reached; nothing was sent and the key is
    /// free again.
    UpstreamUnreachable,
    /// Whether the upstream executed is unknown; the key is settled with this
    /// answer (or released, with `on_ambiguous = "release"`).
    OutcomeUnknown {
        cause: UnknownCause,
        released: bool,
    },
    /// The upstream answered `status` but its body was not kept.
    ResponseNotStored {
        status: u16,
    },
    /// An uncovered request whose upstream exchange failed.
    PassthroughFailed {
        timeout: bool,
    },
    /// The proxy is draining (SIGTERM) and starts no new execution: this
    /// request claimed nothing and was not forwarded.
    ShuttingDown,
    /// A bug in the proxy: the task answering the request ended without an
    /// answer. The key, if claimed, is settled by its lease.
    Internal,
    /// A covered request whose bearer token does not verify: the scope it
    /// names cannot be trusted, so nothing is claimed or forwarded.
    InvalidToken {
        why: String,
    },
    /// A covered request that names no caller, under `anonymous = "reject"`.
    MissingIdentity,
    /// The key's stored record does not read (no configured encryption key
    /// opens it, corrupt bytes, over the size ceiling): the store answered,
    /// so asking again changes nothing until an operator acts, and the
    /// request behind the record may have run, so it is never executed.
    RecordUnreadable,
}

impl Rejection {
    /// The stable slug of the problem type (`type` is `PROBLEM_BASE` + slug).
    pub fn slug(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "missing-key",
            Rejection::InvalidKey(_) => "invalid-key",
            Rejection::BodyTooLarge { .. } => "body-too-large",
            Rejection::BodyUnreadable => "body-unreadable",
            Rejection::InvalidBody { .. } => "invalid-body",
            Rejection::BodyTimeout { .. } => "body-timeout",
            Rejection::KeyReused { .. } => "key-reused",
            Rejection::InFlight { .. } => "in-flight",
            Rejection::StoreUnavailable { .. } => "store-unavailable",
            Rejection::Overloaded { .. } => "overloaded",
            Rejection::UpstreamUnreachable => "upstream-unreachable",
            Rejection::OutcomeUnknown { .. } => "outcome-unknown",
            Rejection::ResponseNotStored { .. } => "response-not-stored",
            Rejection::PassthroughFailed { .. } => "upstream-failed",
            Rejection::Internal => "internal",
            Rejection::ShuttingDown => "shutting-down",
            Rejection::InvalidToken { .. } => "invalid-token",
            Rejection::MissingIdentity => "missing-identity",
            Rejection::RecordUnreadable => "record-unreadable",
        }
    }

    pub fn status(&self, profile: Profile) -> StatusCode {
        match (self, profile) {
            (Rejection::MissingKey, _)
            | (Rejection::InvalidKey(_), _)
            | (Rejection::BodyUnreadable, _)
            | (Rejection::InvalidBody { .. }, _) => StatusCode::BAD_REQUEST,
            (Rejection::BodyTooLarge { .. }, _) => StatusCode::PAYLOAD_TOO_LARGE,
            (Rejection::BodyTimeout { .. }, _) => StatusCode::REQUEST_TIMEOUT,
            (Rejection::KeyReused { .. }, Profile::Default) => StatusCode::CONFLICT,
            (Rejection::KeyReused { .. }, Profile::Ietf) => StatusCode::UNPROCESSABLE_ENTITY,
            (Rejection::InFlight { .. }, Profile::Default) => StatusCode::TOO_EARLY,
            (Rejection::InFlight { .. }, Profile::Ietf) => StatusCode::CONFLICT,
            (Rejection::StoreUnavailable { .. }, _)
            | (Rejection::Overloaded { .. }, _)
            | (Rejection::ShuttingDown, _) => StatusCode::SERVICE_UNAVAILABLE,
            (Rejection::UpstreamUnreachable, _)
            | (Rejection::ResponseNotStored { .. }, _)
            | (Rejection::PassthroughFailed { timeout: false }, _) => StatusCode::BAD_GATEWAY,
            (Rejection::PassthroughFailed { timeout: true }, _) => StatusCode::GATEWAY_TIMEOUT,
            (Rejection::Internal, _) | (Rejection::RecordUnreadable, _) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            (Rejection::InvalidToken { .. }, _) | (Rejection::MissingIdentity, _) => {
                StatusCode::UNAUTHORIZED
            }
            (Rejection::OutcomeUnknown { cause, .. }, _) => {
                StatusCode::from_u16(cause.status()).unwrap_or(StatusCode::BAD_GATEWAY)
            }
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "Idempotency-Key header required",
            Rejection::InvalidKey(_) => "Invalid Idempotency-Key",
            Rejection::BodyTooLarge { .. } => "Request body too large",
            Rejection::BodyUnreadable => "Request body could not be read",
            Rejection::InvalidBody { .. } => "Request body is not JSON the proxy can read",
            Rejection::BodyTimeout { .. } => "Request body too slow",
            Rejection::KeyReused { .. } => "Idempotency-Key reused with a different request",
            Rejection::InFlight { .. } => "A request with this Idempotency-Key is in progress",
            Rejection::StoreUnavailable { .. } => "Idempotency store unavailable",
            Rejection::Overloaded { .. } => "Proxy overloaded",
            Rejection::UpstreamUnreachable => "Upstream unreachable",
            Rejection::OutcomeUnknown { .. } => "Outcome of the original request is unknown",
            Rejection::ResponseNotStored { .. } => "Original response was not stored",
            Rejection::PassthroughFailed { .. } => "Upstream request failed",
            Rejection::Internal => "Internal proxy error",
            Rejection::ShuttingDown => "Proxy shutting down",
            Rejection::InvalidToken { .. } => "Bearer token not accepted",
            Rejection::MissingIdentity => "Caller identity required",
            Rejection::RecordUnreadable => "Stored record for this Idempotency-Key cannot be read",
        }
    }

    fn detail(&self) -> String {
        match self {
            Rejection::MissingKey => {
                "This route requires an Idempotency-Key header on this method.".into()
            }
            Rejection::InvalidKey(why) => format!(
                "{why}. A key is 1 to 255 visible ASCII characters, optionally as a quoted sf-string."
            ),
            Rejection::BodyTooLarge { limit } => {
                format!("The request body exceeds the limit of {limit} bytes.")
            }
            Rejection::BodyUnreadable => {
                "The request body ended before it was complete; nothing was executed.".into()
            }
            Rejection::InvalidBody { at } => format!(
                "This route reads the request's key from its JSON body (`{at}`), and the body does \
                 not parse as standard JSON ({STANDARD_JSON}); nothing was claimed or forwarded."
            ),
            Rejection::BodyTimeout { timeout } => format!(
                "The request body did not arrive within {}; nothing was executed. Retrying is safe.",
                humantime::format_duration(*timeout)
            ),
            Rejection::KeyReused { .. } => "This Idempotency-Key was already used with a different \
                 request (method, path, content or fingerprinted headers). Use a new key for a new \
                 request."
                .into(),
            Rejection::InFlight { .. } => {
                "The first request with this key has not finished yet. Retry after the delay given \
                 in Retry-After to get its response."
                    .into()
            }
            Rejection::StoreUnavailable { .. } => {
                "The idempotency store did not answer in time; the request was not forwarded."
                    .into()
            }
            Rejection::Overloaded { .. } => {
                "The proxy is serving as many requests as it is configured to (max_in_flight); \
                 this one was not read, claimed or forwarded. Retrying is safe."
                    .into()
            }
            Rejection::UpstreamUnreachable => {
                "The upstream could not be reached and the request was never sent. The key was \
                 released: retrying is safe."
                    .into()
            }
            Rejection::OutcomeUnknown { cause, released } => {
                outcome_unknown_detail(*cause, *released)
            }
            Rejection::ResponseNotStored { status } => format!(
                "The original request executed and the upstream answered {status}, but its body was \
                 too large to store (max_response_bytes) or broke off."
            ),
            Rejection::PassthroughFailed { timeout: true } => {
                "The upstream did not answer in time.".into()
            }
            Rejection::PassthroughFailed { timeout: false } => {
                "The upstream could not be reached or the connection broke.".into()
            }
            Rejection::Internal => {
                "The proxy failed to answer this request; see its logs. Do not retry with a new \
                 key before checking whether the request executed."
                    .into()
            }
            Rejection::ShuttingDown => {
                "The proxy is shutting down and starts no new requests; this one was not claimed \
                 or forwarded. Retrying is safe."
                    .into()
            }
            Rejection::InvalidToken { why } => format!(
                "The bearer token was not accepted ({why}); nothing was claimed or forwarded. \
                 Retry with the same key and a valid token."
            ),
            Rejection::MissingIdentity => "This route requires a caller identity (a bearer token \
                 naming the caller); nothing was claimed or forwarded."
                .into(),
            Rejection::RecordUnreadable => RECORD_UNREADABLE.into(),
        }
    }

    fn key_status(&self) -> Option<&'static str> {
        match self {
            Rejection::KeyReused { state } => Some(state.as_str()),
            Rejection::InFlight { .. } => Some(KeyState::Pending.as_str()),
            Rejection::UpstreamUnreachable => Some("released"),
            Rejection::OutcomeUnknown { released: true, .. } => Some("released"),
            Rejection::OutcomeUnknown {
                released: false, ..
            }
            | Rejection::ResponseNotStored { .. } => Some(KeyState::Completed.as_str()),
            _ => None,
        }
    }

    /// Whether a retry with the same key can succeed: the hint SDKs read.
    fn should_retry(&self) -> Option<bool> {
        match self {
            Rejection::KeyReused { .. }
            | Rejection::OutcomeUnknown {
                released: false, ..
            }
            | Rejection::ResponseNotStored { .. }
            | Rejection::MissingKey
            | Rejection::InvalidKey(_)
            | Rejection::InvalidBody { .. }
            | Rejection::InvalidToken { .. }
            | Rejection::MissingIdentity
            | Rejection::RecordUnreadable
            | Rejection::BodyTooLarge { .. } => Some(false),
            Rejection::InFlight { .. }
            | Rejection::StoreUnavailable { .. }
            | Rejection::Overloaded { .. }
            | Rejection::ShuttingDown
            | Rejection::BodyTimeout { .. }
            | Rejection::UpstreamUnreachable
            | Rejection::OutcomeUnknown { released: true, .. } => Some(true),
            Rejection::BodyUnreadable
            | Rejection::PassthroughFailed { .. }
            | Rejection::Internal => None,
        }
    }

    pub fn into_response(self, profile: Profile) -> Response<Body> {
        let mut response = Problem::new(
            self.status(profile),
            self.slug(),
            self.title(),
            self.detail(),
        )
        .key_status(self.key_status())
        .into_response();
        let headers = response.headers_mut();
        if let Some(retry) = self.should_retry() {
            let v = HeaderValue::from_static(if retry { "true" } else { "false" });
            headers.insert(X_SHOULD_RETRY, v.clone());
            headers.insert(STRIPE_SHOULD_RETRY, v);
        }
        if let Rejection::InFlight { retry_after }
        | Rejection::StoreUnavailable { retry_after }
        | Rejection::Overloaded { retry_after } = &self
        {
            // Retry-After has whole seconds; SDKs that read retry-after-ms get
            // the finer hint.
            let secs = retry_after.as_millis().div_ceil(1000).max(1);
            headers.insert(RETRY_AFTER, HeaderValue::from(secs as u64));
            headers.insert(
                RETRY_AFTER_MS,
                HeaderValue::from(retry_after.as_millis() as u64),
            );
        }
        if let Rejection::InvalidToken { .. } = self {
            headers.insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer error=\"invalid_token\""),
            );
        } else if let Rejection::MissingIdentity = self {
            headers.insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
        }
        if let Rejection::ShuttingDown = self {
            headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            // The retry belongs on another connection, to a replica that
            // stays.
            headers.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// What a body that names the key must be, as `invalid-body` says it.
const STANDARD_JSON: &str = "RFC 8259 in UTF-8: no NaN or Infinity, no lone surrogate escapes, \
     numbers within the double range, at most 128 levels deep";

const RECORD_UNREADABLE: &str = "This Idempotency-Key already has a stored record that the proxy \
     cannot read (no configured encryption key opens it, or it is corrupt or too large). The \
     request was not executed, and will not be with this key until an operator inspects the \
     record (`idemproxy keys show`) and removes it (`idemproxy keys forget`). Do not retry: the \
     first request may have taken effect; check before using a new key.";

/// What an `outcome-unknown` answer tells the caller: what happened, and
/// whether a retry with the same key executes again.
fn outcome_unknown_detail(cause: UnknownCause, released: bool) -> String {
    let what = match cause {
        UnknownCause::Timeout => "The upstream did not answer in time",
        UnknownCause::Reset => "The upstream connection broke after the request was sent",
        UnknownCause::Abandoned => {
            "The proxy that was running the request stopped before it finished"
        }
    };
    if released {
        format!(
            "{what}. It may or may not have executed. The key was released, so a retry \
             executes again."
        )
    } else {
        format!(
            "{what}. It may or may not have executed, so it will not be executed again \
             with this key; reconcile with the upstream before using a new key."
        )
    }
}

#[cfg(test)]
mod tests {
    use http::header::CONTENT_TYPE;
    use http_body_util::BodyExt;

    use super::*;

    async fn problem(r: Rejection, profile: Profile) -> (Response<()>, serde_json::Value) {
        let (parts, body) = r.into_response(profile).into_parts();
        let bytes = body.collect().await.expect("body").to_bytes();
        let json = serde_json::from_slice(&bytes).expect("problem json");
        (Response::from_parts(parts, ()), json)
    }

    #[tokio::test]
    async fn profiles_choose_the_status_codes() {
        let reused = Rejection::KeyReused {
            state: KeyState::Completed,
        };
        let in_flight = Rejection::InFlight {
            retry_after: Duration::from_millis(300),
        };
        assert_eq!(reused.status(Profile::Default), 409);
        assert_eq!(reused.status(Profile::Ietf), 422);
        assert_eq!(in_flight.status(Profile::Default), 425);
        assert_eq!(in_flight.status(Profile::Ietf), 409);
    }

    #[tokio::test]
    async fn problems_carry_type_status_and_retry_hints() {
        let (resp, json) = problem(
            Rejection::InFlight {
                retry_after: Duration::from_millis(300),
            },
            Profile::Default,
        )
        .await;
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(resp.headers()[RETRY_AFTER], "1");
        assert_eq!(resp.headers()["retry-after-ms"], "300");
        assert_eq!(resp.headers()["x-should-retry"], "true");
        assert_eq!(resp.headers()["stripe-should-retry"], "true");
        assert_eq!(json["type"], "urn:idemproxy:problem:in-flight");
        assert_eq!(json["status"], 425);
        assert_eq!(json["key_status"], "pending");

        let (resp, json) = problem(
            Rejection::KeyReused {
                state: KeyState::Pending,
            },
            Profile::Ietf,
        )
        .await;
        assert_eq!(resp.status(), 422);
        assert_eq!(resp.headers()["x-should-retry"], "false");
        assert_eq!(resp.headers()["stripe-should-retry"], "false");
        assert_eq!(json["status"], 422);
        assert!(json["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
}
