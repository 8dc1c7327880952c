//! Fault injection: garbage on the wire while the real `idemproxy` binary
//! serves. Malformed request lines and heads, oversized headers, slowloris
//! connections, and keys with obs-text, invalid UTF-8 or control bytes each
//! get a 4xx (the proxy's `invalid-key` problem where the request reaches
//! it, or the HTTP parser's plain 400/431, or a closed connection), never
//! reach the upstream, and never disturb the good requests served
//! concurrently, which all succeed.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemproxy::config::StoreKind;
use support::binary::{get_status, ProxyProcess};
use support::fault::{raw_exchange, slug, Executions, RawAnswer};
use support::proxy::{config, TestClient};
use support::raw;
use support::upstream::TestUpstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;

const BAD: &str = "/v1/bad";
const GOOD: &str = "/v1/good";
const PASS: &str = "/v1/passthrough";
/// No answer to a bad client may take longer.
const BAD_BOUND: Duration = Duration::from_secs(5);
const SLOWLORIS_CONNECTIONS: usize = 10;
const SLOWLORIS_FOR: Duration = Duration::from_secs(3);

/// What a bad client must get.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// The proxy's own 400 problem of this type: the request reached it.
    Problem(&'static str),
    /// The HTTP parser refuses it: a 4xx (400, 431) or the connection is
    /// closed without an answer.
    ParserRefuses,
    /// As [`Expect::ParserRefuses`], or 505 for an HTTP version that does
    /// not exist.
    VersionRefused,
}

fn head(lines: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for line in lines {
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

fn keyed(key: &[u8]) -> Vec<u8> {
    let mut line = b"idempotency-key: ".to_vec();
    line.extend_from_slice(key);
    raw::request(
        "POST",
        BAD,
        &[&line, b"content-type: application/json"],
        b"{}",
    )
}

fn cases() -> Vec<(&'static str, Vec<u8>, Expect)> {
    use Expect::*;
    let big_key = vec![b'k'; 100 * 1024];
    let huge_header = {
        let mut line = b"x-padding: ".to_vec();
        line.extend(std::iter::repeat_n(b'p', 1024 * 1024));
        raw::request("POST", BAD, &[&line, b"idempotency-key: big-1"], b"{}")
    };
    vec![
        ("not http", b"GARBAGE\r\n\r\n".to_vec(), ParserRefuses),
        (
            "binary junk",
            b"\x00\x01\x02\xff\xfe\xfd\r\n\r\n".to_vec(),
            ParserRefuses,
        ),
        (
            "bad method",
            head(&[b"P@ST /v1/bad HTTP/1.1", b"host: x"]),
            ParserRefuses,
        ),
        (
            "unknown version",
            head(&[b"POST /v1/bad HTTP/9.9", b"host: x"]),
            VersionRefused,
        ),
        (
            "no target",
            head(&[b"POST HTTP/1.1", b"host: x"]),
            ParserRefuses,
        ),
        (
            "non-ASCII target",
            head(&[b"POST /v1/bad/\xff\xfe HTTP/1.1", b"host: x"]),
            ParserRefuses,
        ),
        (
            "header without colon",
            head(&[b"POST /v1/bad HTTP/1.1", b"host: x", b"this is no header"]),
            ParserRefuses,
        ),
        (
            "space in header name",
            head(&[b"POST /v1/bad HTTP/1.1", b"host: x", b"bad name: 1"]),
            ParserRefuses,
        ),
        (
            "bad content-length",
            head(&[
                b"POST /v1/bad HTTP/1.1",
                b"host: x",
                b"idempotency-key: cl-1",
                b"content-length: ten",
            ]),
            ParserRefuses,
        ),
        (
            "malformed chunked body",
            head(&[
                b"POST /v1/bad HTTP/1.1",
                b"host: x",
                b"connection: close",
                b"idempotency-key: chunk-1",
                b"transfer-encoding: chunked",
            ])
            .into_iter()
            .chain(b"zz\r\nnot a chunk\r\n".iter().copied())
            .collect(),
            ParserRefuses,
        ),
        ("1 MB header", huge_header, ParserRefuses),
        ("100 KB key", keyed(&big_key), Problem("invalid-key")),
        ("obs-text key", keyed(b"caf\xe9-1"), Problem("invalid-key")),
        (
            "invalid UTF-8 key",
            keyed(b"\xff\xfe\xfd"),
            Problem("invalid-key"),
        ),
        (
            "UTF-8 in a quoted key",
            keyed(b"\"\xc3\xa9t\xc3\xa9\""),
            Problem("invalid-key"),
        ),
        ("control byte in key", keyed(b"ab\x01cd"), ParserRefuses),
        ("space in key", keyed(b"two words"), Problem("invalid-key")),
        ("empty key", keyed(b""), Problem("invalid-key")),
        (
            "two keys",
            raw::request(
                "POST",
                BAD,
                &[b"idempotency-key: a-1", b"idempotency-key: a-2"],
                b"{}",
            ),
            Problem("invalid-key"),
        ),
    ]
}

/// Whether `answer` is what a bad client must get; `Some(why)` if not.
fn check(name: &str, answer: &RawAnswer, expect: Expect) -> Option<String> {
    let status = answer.status();
    let ok = match expect {
        Expect::Problem(want) => {
            status == Some(400) && slug(&answer.reply()).as_deref() == Some(want)
        }
        Expect::ParserRefuses | Expect::VersionRefused => match status {
            None => true,
            Some(s) if (400..500).contains(&s) => true,
            Some(505) => matches!(expect, Expect::VersionRefused),
            Some(_) => false,
        },
    };
    (!ok).then(|| format!("{name}: expected {expect:?}, got {answer:?}"))
}

/// A client that sends a request head one byte every 500 ms until `stop`
/// is set. Returns how many bytes it wrote, and whether the connection was
/// still open then, with nothing sent back by the server.
async fn slowloris(addr: std::net::SocketAddr, stop: Arc<AtomicBool>) -> (usize, bool) {
    let mut stream = TcpStream::connect(addr).await.expect("slowloris connects");
    let head = b"POST /v1/bad HTTP/1.1\r\nhost: x\r\nidempotency-key: slowloris-key-never-ends";
    let mut sent = 0;
    for byte in head.iter().cycle() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        if stream.write_all(&[*byte]).await.is_err() {
            break;
        }
        sent += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Open and silent: a read finds nothing to return (no EOF, no answer).
    let mut buf = [0u8; 64];
    let open = tokio::time::timeout(Duration::from_millis(50), stream.read(&mut buf))
        .await
        .is_err();
    (sent, open)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_wire_gets_4xx_while_good_requests_keep_succeeding() {
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.store.kind = StoreKind::Memory;
    let mut proxy = ProxyProcess::start(c).await;
    let client = TestClient::new();
    let started = Instant::now();

    // Good traffic, all along: covered POSTs with new keys (each sent twice:
    // the second replays), and GETs that pass through. Failures are
    // collected, so that the counts print before the test fails.
    let stop = Arc::new(AtomicBool::new(false));
    let mut good = JoinSet::new();
    for w in 0..2 {
        let (client, stop) = (client.clone(), stop.clone());
        let base = proxy.url("");
        good.spawn(async move {
            let mut tally = Good::default();
            while !stop.load(Ordering::SeqCst) {
                let sent = Instant::now();
                let key = format!("good-{w}-{}", tally.posts);
                let path = format!("{GOOD}/{w}/{}", tally.posts);
                let url = format!("{base}{path}");
                tally.paths.push(path);
                let first = client.post_json(&url, &key, r#"{"ok":true}"#).await;
                let again = client.post_json(&url, &key, r#"{"ok":true}"#).await;
                tally.posts += 1;
                if first.status != 201 || first.replayed() {
                    tally.failures.push(format!("POST {key}: {first:?}"));
                }
                if again.status != 201 || !again.replayed() || again.body != first.body {
                    tally.failures.push(format!("POST {key} again: {again:?}"));
                }
                let got = client
                    .send(http::Method::GET, &format!("{base}{PASS}"), &[], "")
                    .await;
                tally.gets += 1;
                if got.status != 201 {
                    tally.failures.push(format!("GET: {got:?}"));
                }
                tally.slowest = tally.slowest.max(sent.elapsed());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tally
        });
    }

    let slow_stop = Arc::new(AtomicBool::new(false));
    let mut slow = JoinSet::new();
    for _ in 0..SLOWLORIS_CONNECTIONS {
        slow.spawn(slowloris(proxy.addr, slow_stop.clone()));
    }

    // The bad clients, all at once, twice over.
    let mut bad = JoinSet::new();
    for _round in 0..2 {
        for (name, request, expect) in cases() {
            let addr = proxy.addr;
            bad.spawn(async move {
                let answer = raw_exchange(addr, &request, BAD_BOUND).await;
                (name, answer.status(), check(name, &answer, expect))
            });
        }
    }
    let bad_answers = bad.join_all().await;

    // Keep the slowloris connections open a while longer under good traffic.
    tokio::time::sleep_until(started + SLOWLORIS_FOR).await;
    slow_stop.store(true, Ordering::SeqCst);
    let trickled: Vec<(usize, bool)> = slow.join_all().await;
    stop.store(true, Ordering::SeqCst);
    let good_done: Vec<Good> = good.join_all().await;

    let posts: usize = good_done.iter().map(|g| g.posts).sum();
    let gets: usize = good_done.iter().map(|g| g.gets).sum();
    let slowest = good_done
        .iter()
        .map(|g| g.slowest)
        .max()
        .unwrap_or_default();
    let good_failures: Vec<&String> = good_done.iter().flat_map(|g| &g.failures).collect();
    let bad_failures: Vec<&String> = bad_answers.iter().filter_map(|a| a.2.as_ref()).collect();
    let mut by_status = std::collections::BTreeMap::<String, usize>::new();
    for (_, status, _) in &bad_answers {
        let key = status.map_or("closed".to_string(), |s| s.to_string());
        *by_status.entry(key).or_default() += 1;
    }
    let executions = Executions::count(
        &upstream,
        good_done
            .iter()
            .flat_map(|g| g.paths.iter().map(String::as_str))
            .chain([BAD]),
    );
    println!(
        "garbage: operations={posts} duplicates={posts} executions={} passthrough={} \
         bad_clients={} bad_answers={by_status:?} slowloris={SLOWLORIS_CONNECTIONS}x{:?} \
         (bytes each {:?}) good_failures={} bad_failures={} slowest_good={slowest:?}",
        executions.total,
        upstream.executions(PASS),
        bad_answers.len(),
        SLOWLORIS_FOR,
        trickled.iter().map(|t| t.0).collect::<Vec<_>>(),
        good_failures.len(),
        bad_failures.len(),
    );
    for (name, status, _) in bad_answers.iter().take(cases().len()) {
        println!("  garbage case {name:?}: {status:?}");
    }

    executions.assert_at_most_once();
    assert!(
        good_failures.is_empty(),
        "good requests failed: {good_failures:#?}"
    );
    assert!(bad_failures.is_empty(), "bad clients: {bad_failures:#?}");
    // Every slowloris connection stayed open and unanswered (the server
    // waits for the head, up to its header read timeout) while the good
    // requests went through.
    let min_bytes = (SLOWLORIS_FOR.as_millis() / 500 - 1) as usize;
    for (i, (n, open)) in trickled.iter().enumerate() {
        assert!(*n >= min_bytes, "slowloris {i} wrote only {n} bytes");
        assert!(*open, "slowloris {i} was closed or answered early");
    }
    assert!(posts >= 20, "only {posts} good requests ran alongside");
    assert!(proxy.is_running(), "the proxy died:\n{}", proxy.logs());
    assert_eq!(get_status(proxy.admin_addr, "/healthz").await, Some(200));
    // Nothing bad reached the upstream; every good POST executed once.
    assert_eq!(upstream.executions(BAD), 0, "a bad request was forwarded");
    assert_eq!(executions.total, posts, "every good POST executed once");
    assert_eq!(upstream.executions(PASS), gets);
    assert_eq!(upstream.total(), posts + gets);
}

/// What one good-traffic worker saw.
#[derive(Default)]
struct Good {
    posts: usize,
    gets: usize,
    slowest: Duration,
    failures: Vec<String>,
    /// The path of each POST (one per key).
    paths: Vec<String>,
}
