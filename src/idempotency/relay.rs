//! The executed request's response: relayed to the client as it comes
//! while a bounded copy is kept, and stored before the client can see the
//! body end, so a retry sent on receipt finds the record.
//!
//! A small body of declared length that is already there with the head
//! (the usual API answer) is read whole and sent in one piece after
//! storing: one hand-off instead of one per frame. Any other body streams
//! as it comes; as a client knows a body with a `Content-Length` is
//! complete once it has that many bytes, the frame that completes it is
//! held back until the outcome is stored. A body without a length or
//! chunking ends where the upstream's connection does, so a cut one looks
//! complete: it is relayed but stored as not stored.

use std::collections::VecDeque;

use axum::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http::response::Parts;
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::time::error::Elapsed;
use tokio::time::Instant;

use super::body::{channel_body, BodySender, BoundedCopy};
use super::context::Responder;
use super::replay::{stored_headers, stored_outcome};
use super::settle::Holder;
use crate::http::headers::content_length;
use crate::http::CloseDelimited;
use crate::observe::RequestOutcome;

/// Bodies up to this size, with a declared length, are relayed in one piece
/// after the outcome is stored.
const WHOLE_BODY_LIMIT: u64 = 64 * 1024;

/// What reading the upstream's body gave: a frame, its end (`None`), a
/// broken body, or the deadline.
type Read = Result<Option<Result<Frame<Bytes>, axum::Error>>, Elapsed>;

/// Relays `response` while keeping a bounded copy, and stores the
/// outcome before the client can see the body end.
pub(super) async fn stream_and_store(
    mut holder: Holder,
    response: Response<Body>,
    deadline: Instant,
    respond: Responder,
) {
    let (head, mut upstream) = response.into_parts();
    holder.cx.log.set_status(head.status.as_u16());
    let declared = content_length(&head.headers);
    let max_response_bytes = holder.cx.policy.settings.max_response_bytes;
    let mut copy = BoundedCopy::new(max_response_bytes);
    let whole_limit = WHOLE_BODY_LIMIT.min(max_response_bytes as u64);
    // The body's end is only the upstream's close: a FIN halfway looks
    // the same, so the body is relayed as it comes but never stored as
    // the response (a retry is told it was not stored).
    let close_delimited = head.extensions.get::<CloseDelimited>().is_some();
    let small = declared.is_some_and(|len| len <= whole_limit)
        || head.status == StatusCode::NO_CONTENT
        || head.status == StatusCode::NOT_MODIFIED;
    // Frames read before deciding to stream, and how the body ended if
    // it already did.
    let (early, ended) = if small {
        read_ready(&mut upstream, &mut copy, deadline).await
    } else {
        (Vec::new(), None)
    };
    if let Some(complete) = ended {
        return store_whole(holder, head, copy, complete, respond).await;
    }
    let (tx, client_body) = channel_body(16);
    let stored_headers = stored_headers(&head.headers);
    let status = head.status.as_u16();
    let _ = respond.send(Response::from_parts(head, client_body));
    let mut relay = Relay {
        client: Some(tx),
        backlog: VecDeque::new(),
        held: Vec::new(),
        relayed: 0,
        declared,
        deadline,
        copy,
    };
    let complete = relay.run(early, &mut upstream).await;
    let body = if complete && !close_delimited {
        relay.copy.take()
    } else {
        None
    };
    holder
        .complete(stored_outcome(status, stored_headers, body))
        .await;
    relay.finish(complete).await;
    holder.cx.log.finish_streamed(RequestOutcome::Executed);
}

/// Stores a body that was read whole, then sends it in one piece (or,
/// broken off, as a body that fails).
async fn store_whole(
    mut holder: Holder,
    head: Parts,
    copy: BoundedCopy,
    complete: bool,
    respond: Responder,
) {
    let body = if complete { copy.finish() } else { None };
    let client_body = match &body {
        Some(body) => Body::from(body.clone()),
        None => broken_body(),
    };
    let outcome = stored_outcome(head.status.as_u16(), stored_headers(&head.headers), body);
    holder.complete(outcome).await;
    let _ = respond.send(Response::from_parts(head, client_body));
    holder.cx.log.finish_streamed(RequestOutcome::Executed);
}

/// Reads the first frame (waiting up to `deadline`) and then only what is
/// already there: a body that trickles in is streamed instead. Returns the
/// frames read and, if the body ended, whether it completed.
async fn read_ready(
    upstream: &mut Body,
    copy: &mut BoundedCopy,
    deadline: Instant,
) -> (Vec<Frame<Bytes>>, Option<bool>) {
    let mut early = Vec::new();
    loop {
        let next = if early.is_empty() {
            match tokio::time::timeout_at(deadline, upstream.frame()).await {
                Ok(next) => next,
                Err(_elapsed) => return (early, Some(false)),
            }
        } else {
            match upstream.frame().now_or_never() {
                Some(next) => next,
                None => return (early, None),
            }
        };
        match next {
            None => return (early, Some(true)),
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    copy.push(data);
                }
                early.push(frame);
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "upstream response body broke off");
                return (early, Some(false));
            }
        }
    }
}

/// A streamed relay: the upstream's frames to the client, as it takes
/// them, and into the copy that gets stored.
struct Relay {
    /// The client's body; `None` once it is gone.
    client: Option<BodySender>,
    /// Frames the client could not take yet. While the copy is whole they
    /// are buffers it shares, so this holds no more than
    /// `max_response_bytes` of its own.
    backlog: VecDeque<Frame<Bytes>>,
    /// The frames that complete a declared length, held back until the
    /// outcome is stored.
    held: Vec<Frame<Bytes>>,
    relayed: u64,
    declared: Option<u64>,
    deadline: Instant,
    copy: BoundedCopy,
}

impl Relay {
    /// Relays `early` (already in the copy), then the rest of `upstream`;
    /// whether the body completed.
    async fn run(&mut self, early: Vec<Frame<Bytes>>, upstream: &mut Body) -> bool {
        let mut early = early.into_iter();
        loop {
            let frame = match early.next() {
                Some(frame) => frame,
                None => match self.read(upstream).await {
                    Err(_elapsed) => return false,
                    Ok(None) => return true,
                    Ok(Some(Err(e))) => {
                        tracing::warn!(error = %e, "upstream response body broke off");
                        return false;
                    }
                    Ok(Some(Ok(frame))) => {
                        if let Some(data) = frame.data_ref() {
                            self.copy.push(data);
                        }
                        frame
                    }
                },
            };
            self.relay(frame).await;
        }
    }

    /// The upstream's next frame. What the client could not take yet goes
    /// to it as it makes room, while the upstream is read: a client that
    /// catches up must not wait for the upstream's next frame (a stream of
    /// events may pause between them).
    async fn read(&mut self, upstream: &mut Body) -> Read {
        loop {
            let Some(tx) = self.client.as_ref().filter(|_| !self.backlog.is_empty()) else {
                return tokio::time::timeout_at(self.deadline, upstream.frame()).await;
            };
            let fed = tokio::select! {
                read = tokio::time::timeout_at(self.deadline, upstream.frame()) => Err(read),
                sent = tx.send_front(&mut self.backlog) => Ok(sent),
            };
            match fed {
                Err(read) => return read,
                Ok(true) => {}
                Ok(false) => self.client_gone(),
            }
        }
    }

    /// Passes `frame` on to the client, or holds it back if it completes
    /// the declared length.
    async fn relay(&mut self, frame: Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.relayed += data.len() as u64;
        }
        if self.declared.is_some_and(|len| self.relayed >= len) {
            self.held.push(frame);
            return;
        }
        let Some(tx) = &self.client else {
            return;
        };
        self.backlog.push_back(frame);
        let keeps_up = if self.copy.is_whole() {
            // The copy is what gets stored, so a client that stops reading
            // must not hold up the upstream read: waiting for it would use
            // up the deadline, and a response the upstream sent in time
            // would be stored as incomplete.
            tx.offer(&mut self.backlog)
        } else {
            // Past the cap only the status is stored, whatever the client
            // does: it sets the pace, up to the deadline, after which it is
            // dropped, unfinished, so its body aborts.
            tx.send_all(&mut self.backlog, self.deadline).await
        };
        if !keeps_up {
            self.client_gone();
        }
    }

    /// The client left: what waited for it is only the copy's now.
    fn client_gone(&mut self) {
        self.client = None;
        self.backlog.clear();
    }

    /// After the outcome is stored: the held-back frames and the body's
    /// end, or, unfinished, an error that aborts the body once the client
    /// has read what was sent (the error says why if there is room for it:
    /// a client that reads nothing must not hold this run).
    async fn finish(mut self, complete: bool) {
        let Some(tx) = self.client.take() else {
            return;
        };
        if complete {
            self.backlog.extend(self.held.drain(..));
            if tx.send_all(&mut self.backlog, self.deadline).await {
                tx.finish();
            }
        } else {
            let _ = tx.try_send(Err("upstream response body did not complete".into()));
        }
    }
}

/// A body that fails at once: the client sees a broken response rather than
/// a complete-looking truncated one.
fn broken_body() -> Body {
    let (tx, body) = channel_body(1);
    let _ = tx.try_send(Err("upstream response body did not complete".into()));
    body
}
