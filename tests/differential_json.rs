//! Whatever an upstream's JSON parser accepts is either protected or
//! refused, never forwarded keyless (DESIGN §1, "Fail closed on what the
//! proxy cannot read").
//!
//! Python's `json` is the reference upstream: it reads `NaN`, `Infinity`,
//! lone surrogate escapes, `1e400`, integers of any size, deep nesting, and
//! bodies with a byte-order mark or in UTF-16, none of which serde_json
//! takes. Generated JSON-ish bodies (valid JSON and those Python-only forms)
//! go to ONE `python3` process, which says for each whether `json.loads`
//! accepts it and what member `/key` holds. For every body Python accepts,
//! the proxy's key rules must refuse the request or key it exactly as
//! Python reads the member; and through the real proxy, no such body runs
//! twice when sent twice.

use crate::support;

use std::io::Write;
use std::process::{Command, Stdio};

use base64::Engine;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

use http::Request;
use idemproxy::request::key::IdempotencyKey;
use idemproxy::request::key_source::{KeyRefusal, KeyRules};
use support::proxy::{config, TestClient, TestProxy};
use support::upstream::TestUpstream;

const PATH: &str = "/v1/differential";
const CASES: usize = 256;

/// Reads base64 bodies, one a line; prints one verdict a line: `REJECT`,
/// `ABSENT` (no object, no member, or `null`), `STR <base64 of the UTF-8,
/// surrogates passed through>`, `INT <decimal>`, or `OTHER`.
const PYTHON: &str = r#"
import base64, json, sys
out = []
for line in sys.stdin.buffer:
    body = base64.b64decode(line.strip())
    try:
        doc = json.loads(body)
    except Exception:
        out.append("REJECT")
        continue
    if not isinstance(doc, dict) or doc.get("key") is None:
        out.append("ABSENT")
        continue
    v = doc["key"]
    if isinstance(v, bool):
        out.append("OTHER")
    elif isinstance(v, str):
        out.append("STR " + base64.b64encode(v.encode("utf-8", "surrogatepass")).decode())
    elif isinstance(v, int):
        out.append("INT " + str(v))
    else:
        out.append("OTHER")
sys.stdout.write("\n".join(out) + "\n")
"#;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Python {
    Reject,
    Absent,
    Key(Vec<u8>),
    Other,
}

/// What Python's `json` makes of each body, from one `python3` process.
fn python_verdicts(bodies: &[Vec<u8>]) -> Vec<Python> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut child = Command::new("python3")
        .args(["-c", PYTHON])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("this test needs python3 on PATH (the reference JSON parser); install it");
    let mut input = Vec::new();
    for body in bodies {
        input.extend_from_slice(b64.encode(body).as_bytes());
        input.push(b'\n');
    }
    // Written from a thread: a pipe holds less than the whole input, and
    // python3 answers only at the end.
    let mut stdin = child.stdin.take().expect("python3's stdin");
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let output = child.wait_with_output().expect("python3 runs");
    writer
        .join()
        .expect("writer thread")
        .expect("bodies written to python3");
    assert!(output.status.success(), "python3 failed: {output:?}");
    let text = String::from_utf8(output.stdout).expect("python3 prints ASCII");
    let verdicts: Vec<Python> = text
        .lines()
        .map(|line| match line.split_once(' ') {
            None if line == "REJECT" => Python::Reject,
            None if line == "ABSENT" => Python::Absent,
            None if line == "OTHER" => Python::Other,
            Some(("STR", text)) => Python::Key(b64.decode(text).expect("base64 from python3")),
            Some(("INT", digits)) => Python::Key(digits.as_bytes().to_vec()),
            _ => panic!("python3 printed {line:?}"),
        })
        .collect();
    assert_eq!(verdicts.len(), bodies.len(), "one verdict per body");
    verdicts
}

fn ws() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["", "", "", " ", "\n", "\t", "\r\n  "])
}

fn string_literal() -> impl Strategy<Value = String> {
    let pieces = vec![
        "a",
        "Z",
        "0",
        "-",
        "_",
        "\\u0041",
        "\\ud800",
        "\\udc00",
        "\\udbff",
        "\\ud83d\\ude00",
        "é",
        "\\n",
        " ",
        "\\\"",
        "\\\\",
        "\\/",
    ];
    prop::collection::vec(prop::sample::select(pieces), 0..6)
        .prop_map(|parts| format!("\"{}\"", parts.concat()))
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        "-?[1-9][0-9]{18,40}",
        prop::sample::select(vec![
            "0",
            "-0",
            "1.5",
            "-0.0",
            "1e400",
            "-1e400",
            "1E-400",
            "2.5e-3",
            "1e308",
            "1.0",
            "NaN",
            "Infinity",
            "-Infinity",
        ])
        .prop_map(String::from),
    ]
}

fn value() -> impl Strategy<Value = String> {
    let scalar = prop_oneof![
        prop::sample::select(vec!["null", "true", "false"]).prop_map(String::from),
        number(),
        string_literal(),
    ];
    scalar.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            (prop::collection::vec(inner.clone(), 0..4), ws())
                .prop_map(|(items, ws)| format!("[{ws}{}{ws}]", items.join(&format!(",{ws}")))),
            (prop::collection::vec(("[a-z]{1,3}", inner), 0..4), ws()).prop_map(|(members, ws)| {
                let members: Vec<String> = members
                    .iter()
                    .map(|(name, v)| format!("\"{name}\"{ws}:{ws}{v}"))
                    .collect();
                format!("{{{ws}{}{ws}}}", members.join(","))
            }),
        ]
    })
}

/// What `/key` holds: mostly usable keys (plain, escaped, integers), and
/// every form a key source must not misread.
fn key_value() -> impl Strategy<Value = String> {
    let escaped = vec!["a", "k", "1", "-", "\\u0041", "\\u002d", "\\/", "\\u006b"];
    prop_oneof![
        3 => "[A-Za-z0-9_-]{1,20}".prop_map(|s| format!("\"{s}\"")),
        2 => prop::collection::vec(prop::sample::select(escaped), 1..8)
            .prop_map(|parts| format!("\"{}\"", parts.concat())),
        1 => prop::sample::select(vec!["\\ud800", "\\udc00", "\\udbff\\u0041"])
            .prop_map(|s| format!("\"k{s}\"")),
        2 => number(),
        1 => Just("null".to_owned()),
        1 => value(),
    ]
}

/// A body: an object holding (or not) `/key`, once or twice (duplicate
/// names), among other members, maybe one nested deeper than serde_json
/// reads; or, now and then, not an object at all. Its bytes are UTF-8,
/// sometimes after a byte-order mark, sometimes UTF-16.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let member = ("[a-z]{1,4}", value()).prop_map(|(n, v)| format!("\"{n}\": {v}"));
    let object = (
        prop::collection::vec(member, 0..4),
        prop::option::weighted(0.85, key_value()),
        prop::option::weighted(0.1, key_value()),
        prop::option::weighted(0.1, 100usize..300),
        any::<prop::sample::Index>(),
        ws(),
        ws(),
    )
        .prop_map(|(mut members, key, again, deep, at, ws1, ws2)| {
            if let Some(depth) = deep {
                members.push(format!(
                    "\"deep\": {}{}",
                    "[".repeat(depth),
                    "]".repeat(depth)
                ));
            }
            for k in [key, again].into_iter().flatten() {
                let at = at.index(members.len() + 1);
                members.insert(at, format!("\"key\"{ws1}:{ws2}{k}"));
            }
            format!(
                "{ws1}{{{ws2}{}{ws2}}}{ws1}",
                members.join(&format!(",{ws1}"))
            )
        });
    let text = prop_oneof![9 => object, 1 => value()];
    (text, 0u8..20).prop_map(|(text, encoding)| match encoding {
        0 => [b"\xEF\xBB\xBF".as_slice(), text.as_bytes()].concat(),
        1 => {
            let mut out = vec![0xFF, 0xFE];
            for unit in text.encode_utf16() {
                out.extend_from_slice(&unit.to_le_bytes());
            }
            out
        }
        _ => text.into_bytes(),
    })
}

/// Bodies that must always be in the run, whatever the generator draws.
fn fixed_bodies() -> Vec<Vec<u8>> {
    [
        r#"{"key": "k-1", "amount": NaN}"#,
        r#"{"key": "k-1", "amount": Infinity}"#,
        r#"{"key": "k-1", "amount": -Infinity}"#,
        r#"{"key": "k-1", "note": "\ud800"}"#,
        r#"{"key": "k-1", "note": "\udc00"}"#,
        r#"{"key": "k-1", "n": 1e400}"#,
        r#"{"key": "k-1", "key": "k-2"}"#,
        r#"{"key": 123456789012345678901234567890}"#,
        r#"{"key": -0}"#,
        r#"{"key": "k\u002d1"}"#,
        r#"{"key": "\"quoted\""}"#,
        "\u{feff}{\"key\": \"bom\"}",
        r#"{"other": 1}"#,
        "[1, 2]",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// The key a member's text names, read by the key syntax every source
/// shares (DESIGN §1: an RFC 8941 sf-string such as `"abc"` is unquoted).
fn as_key(text: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(text).ok()?;
    text.parse::<IdempotencyKey>()
        .ok()
        .map(IdempotencyKey::into_string)
}

fn rules(from: &[&str], derive: &[&str]) -> KeyRules {
    KeyRules::new(
        from.iter()
            .map(|s| s.parse().expect("key source"))
            .collect(),
        derive
            .iter()
            .map(|s| s.parse().expect("key attribute"))
            .collect(),
    )
    .for_route("differential")
}

#[tokio::test]
async fn what_python_json_accepts_is_protected_or_refused_never_keyless() {
    let mut runner = TestRunner::default();
    let strategy = body();
    let mut bodies = fixed_bodies();
    for _ in 0..CASES {
        let tree = strategy.new_tree(&mut runner).expect("a body");
        bodies.push(tree.current());
    }
    let verdicts = python_verdicts(&bodies);

    let from_json = rules(&["json:/key"], &[]);
    let derived = rules(&[], &["json:/key"]);
    let parts = Request::post(PATH)
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts()
        .0;
    let mut accepted_with_member = Vec::new();
    for (body, python) in bodies.iter().zip(&verdicts) {
        if *python == Python::Reject {
            continue;
        }
        let shown = String::from_utf8_lossy(body);
        match (from_json.from_request(&parts, body), python) {
            (Err(KeyRefusal::UnreadableBody { .. } | KeyRefusal::Invalid(_)), _) => {}
            (Ok(Some(key)), Python::Key(expected)) => assert_eq!(
                Some(key.as_str()),
                as_key(expected).as_deref(),
                "keyed otherwise than Python reads the member: {shown}"
            ),
            (Ok(Some(key)), other) => {
                panic!("keyed {key:?} where Python reads {other:?}: {shown}")
            }
            (Ok(None), Python::Absent) => {}
            (Ok(None), other) => {
                panic!("forwarded keyless where Python reads {other:?}: {shown}")
            }
        }
        match (derived.from_request(&parts, body), python) {
            (Ok(None), Python::Key(_) | Python::Other) => {
                panic!("derived no key where Python reads a member: {shown}")
            }
            (Ok(Some(_)), Python::Absent) => {
                panic!("derived a key where Python reads no member: {shown}")
            }
            _ => {}
        }
        if *python != Python::Absent {
            accepted_with_member.push(body.clone());
        }
    }
    assert!(
        accepted_with_member.len() >= CASES / 4,
        "the generator draws enough bodies Python reads a key in ({} of {})",
        accepted_with_member.len(),
        bodies.len()
    );

    // Through the real proxy: each such body sent twice runs at most once.
    let upstream = TestUpstream::start().await;
    let mut c = config(&upstream.url());
    c.idempotency.key_from = vec!["json:/key".into()];
    let proxy = TestProxy::start(c).await;
    let client = TestClient::new();
    let url = proxy.url(PATH);
    let headers = [("content-type", "application/json")];
    for body in &accepted_with_member {
        let shown = String::from_utf8_lossy(body);
        let before = upstream.executions(PATH);
        let first = client
            .send(http::Method::POST, &url, &headers, body.clone())
            .await;
        let after_first = upstream.executions(PATH);
        let second = client
            .send(http::Method::POST, &url, &headers, body.clone())
            .await;
        assert_eq!(
            upstream.executions(PATH),
            after_first,
            "sent twice, ran twice: {shown}\nfirst {first:?}\nsecond {second:?}"
        );
        if first.status == 400 {
            assert_eq!(after_first, before, "refused yet forwarded: {shown}");
            let slug = first.problem();
            assert!(
                slug == "invalid-body" || slug == "invalid-key",
                "{slug}: {shown}"
            );
        }
    }
}
