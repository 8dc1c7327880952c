//! Bodies of the covered path: reading the request under its cap, and the
//! response body fed by the task that keeps reading the upstream after the
//! client has gone. Also the passthrough's response body, which carries its
//! `max_in_flight` permit while it streams.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::time::{Instant, Sleep};

use super::rejection::Rejection;

pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Reads a request body of at most `limit` bytes. A `declared` length
/// (`Content-Length`) over the limit is refused before reading anything.
pub(super) async fn read_request_body(
    declared: Option<u64>,
    body: Body,
    limit: usize,
) -> Result<Bytes, Rejection> {
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Rejection::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(Rejection::BodyTooLarge { limit })
        }
        Err(_) => Err(Rejection::BodyUnreadable),
    }
}

/// A request body read whole under its cap, or, past the cap, given back
/// whole (what was read, then the rest) to be forwarded as it came: what
/// observe mode does, where nothing may refuse a request enforcement
/// would refuse.
pub(super) enum ReadOrKeep {
    Whole(Bytes),
    TooLarge(Body),
}

pub(super) async fn read_or_keep(
    declared: Option<u64>,
    mut body: Body,
    limit: usize,
) -> Result<ReadOrKeep, Rejection> {
    if declared.is_some_and(|len| len > limit as u64) {
        return Ok(ReadOrKeep::TooLarge(body));
    }
    let mut read: Vec<Bytes> = Vec::new();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Err(Rejection::BodyUnreadable);
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        len += data.len();
        read.push(data);
        if len > limit {
            let read = futures_util::stream::iter(read.into_iter().map(Ok::<_, axum::Error>));
            let rest = http_body_util::BodyDataStream::new(body);
            return Ok(ReadOrKeep::TooLarge(Body::from_stream(
                futures_util::StreamExt::chain(read, rest),
            )));
        }
    }
    let mut whole = BytesMut::with_capacity(len);
    for chunk in read {
        whole.extend_from_slice(&chunk);
    }
    Ok(ReadOrKeep::Whole(whole.freeze()))
}

/// Keeps a copy of a response body up to a cap; past it, gives the copy up
/// (the client still gets every byte).
pub(super) struct BoundedCopy {
    chunks: Vec<Bytes>,
    len: usize,
    limit: usize,
    overflowed: bool,
}

impl BoundedCopy {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
            limit,
            overflowed: false,
        }
    }

    pub(super) fn push(&mut self, data: &Bytes) {
        if self.overflowed {
            return;
        }
        if self.len + data.len() > self.limit {
            self.overflowed = true;
            self.chunks = Vec::new();
            return;
        }
        self.len += data.len();
        // A clone of `Bytes` shares the buffer: the one copy is in `finish`.
        self.chunks.push(data.clone());
    }

    /// Whether the copy is still whole: what [`Self::finish`] gives if the
    /// body ends now.
    pub(super) fn is_whole(&self) -> bool {
        !self.overflowed
    }

    /// [`BoundedCopy::finish`], leaving an empty copy behind.
    pub(super) fn take(&mut self) -> Option<Bytes> {
        std::mem::replace(self, Self::new(self.limit)).finish()
    }

    /// The whole body, or `None` if it went over the cap.
    pub(super) fn finish(self) -> Option<Bytes> {
        if self.overflowed {
            return None;
        }
        // Always copied into a buffer of its own: a chunk from hyper is a
        // slice of the connection's read buffer, and keeping it in a store
        // (memory, the local cache) would pin that whole buffer for the TTL
        // (measured: ~9 KiB per stored record instead of its size).
        let mut out = BytesMut::with_capacity(self.len);
        for c in self.chunks {
            out.extend_from_slice(&c);
        }
        Some(out.freeze())
    }
}

/// A response body fed frame by frame from another task. It ends only when
/// its [`BodySender`] says so ([`BodySender::finish`]); a sender dropped
/// before that, or one that sends an error, aborts it: the client sees a
/// broken body, never a truncated one that looks complete (a chunked body
/// would otherwise end cleanly when a stalled client's sender is dropped).
pub(super) struct ChannelBody {
    rx: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
    finished: Arc<AtomicBool>,
    /// Set once the abort was reported: the body then ends.
    aborted: bool,
}

/// The sending half of a [`ChannelBody`].
pub(super) struct BodySender {
    tx: mpsc::Sender<Result<Frame<Bytes>, BoxError>>,
    finished: Arc<AtomicBool>,
}

impl BodySender {
    /// Waits for room and sends `frame`; an error if the body was dropped.
    pub(super) async fn send(&self, frame: Result<Frame<Bytes>, BoxError>) -> Result<(), BoxError> {
        self.tx
            .send(frame)
            .await
            .map_err(|_| "the client's body is gone".into())
    }

    /// Sends `frame` if there is room now; gives it back otherwise.
    pub(super) fn try_send(
        &self,
        frame: Result<Frame<Bytes>, BoxError>,
    ) -> Result<(), TrySendError<Result<Frame<Bytes>, BoxError>>> {
        self.tx.try_send(frame)
    }

    /// Sends the frames of `backlog` the channel has room for now, without
    /// waiting; false if the body was dropped.
    pub(super) fn offer(&self, backlog: &mut VecDeque<Frame<Bytes>>) -> bool {
        while let Some(frame) = backlog.pop_front() {
            match self.tx.try_send(Ok(frame)) {
                Ok(()) => {}
                Err(TrySendError::Full(Ok(frame))) => {
                    backlog.push_front(frame);
                    return true;
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// Waits for room and sends the first frame of `backlog`; false if the
    /// body was dropped. Cancel-safe: the frame leaves `backlog` only with
    /// room to go to.
    pub(super) async fn send_front(&self, backlog: &mut VecDeque<Frame<Bytes>>) -> bool {
        let Ok(room) = self.tx.reserve().await else {
            return false;
        };
        if let Some(frame) = backlog.pop_front() {
            room.send(Ok(frame));
        }
        true
    }

    /// Sends every frame of `backlog`, waiting for room until `deadline`;
    /// false if the body was dropped or the deadline came first.
    pub(super) async fn send_all(
        &self,
        backlog: &mut VecDeque<Frame<Bytes>>,
        deadline: Instant,
    ) -> bool {
        while let Some(frame) = backlog.pop_front() {
            let sent = tokio::time::timeout_at(deadline, self.send(Ok(frame))).await;
            if !matches!(sent, Ok(Ok(()))) {
                return false;
            }
        }
        true
    }

    /// The body is complete: the client sees it end after what was sent.
    pub(super) fn finish(self) {
        // Stored before the channel closes (when `self.tx` drops, below),
        // so the reader, which looks once it sees the channel closed, sees
        // it.
        self.finished.store(true, Ordering::Release);
    }
}

/// A sender and the response body it feeds.
pub(super) fn channel_body(capacity: usize) -> (BodySender, Body) {
    let (tx, rx) = mpsc::channel(capacity);
    let finished = Arc::new(AtomicBool::new(false));
    let body = ChannelBody {
        rx,
        finished: Arc::clone(&finished),
        aborted: false,
    };
    (BodySender { tx, finished }, Body::new(body))
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(None) if !self.aborted && !self.finished.load(Ordering::Acquire) => {
                self.aborted = true;
                Poll::Ready(Some(Err("the response body was cut off".into())))
            }
            other => other,
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// A response body that holds a value (a `max_in_flight` permit) until the
/// body is dropped: hyper drops it once the last frame is written or the
/// client has gone, so a streaming passthrough counts as long as it streams.
/// It ends in an error at `deadline` (`upstream.timeout` from the request's
/// arrival, as for covered requests): an upstream that stops sending in the
/// middle of a body must not hold the slot for as long as the client waits.
struct Holding<T> {
    body: Body,
    _held: T,
    deadline: Instant,
    /// Started at the first frame that is not ready at once: a body that
    /// is all there (the usual answer) never touches the timer.
    timer: Option<Pin<Box<Sleep>>>,
    expired: bool,
}

/// `body`, holding `held` until it is dropped, cut off at `deadline`.
pub(super) fn holding<T: Send + Unpin + 'static>(body: Body, held: T, deadline: Instant) -> Body {
    Body::new(Holding {
        body,
        _held: held,
        deadline,
        timer: None,
        expired: false,
    })
}

impl<T: Unpin> http_body::Body for Holding<T> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.expired {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        let deadline = self.deadline;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.expired = true;
                Poll::Ready(Some(Err(axum::Error::new(
                    "the upstream's response body outlived upstream.timeout",
                ))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::headers::content_length;
    use http::HeaderMap;

    #[test]
    fn bounded_copy_keeps_bodies_up_to_the_cap() {
        let mut copy = BoundedCopy::new(6);
        copy.push(&Bytes::from_static(b"abc"));
        copy.push(&Bytes::from_static(b"def"));
        assert_eq!(copy.finish().as_deref(), Some(&b"abcdef"[..]));

        let mut copy = BoundedCopy::new(5);
        copy.push(&Bytes::from_static(b"abc"));
        copy.push(&Bytes::from_static(b"def"));
        copy.push(&Bytes::from_static(b"g"));
        assert_eq!(copy.finish(), None);
    }

    #[tokio::test]
    async fn request_bodies_over_the_limit_are_refused() {
        let headers = HeaderMap::new();
        let ok = read_request_body(content_length(&headers), Body::from("12345"), 5).await;
        assert_eq!(ok.as_deref(), Ok(&b"12345"[..]));
        let too_big = read_request_body(content_length(&headers), Body::from("123456"), 5).await;
        assert_eq!(too_big, Err(Rejection::BodyTooLarge { limit: 5 }));

        let mut declared = HeaderMap::new();
        declared.insert(http::header::CONTENT_LENGTH, 100.into());
        let early = read_request_body(content_length(&declared), Body::empty(), 5).await;
        assert_eq!(early, Err(Rejection::BodyTooLarge { limit: 5 }));
    }
}
