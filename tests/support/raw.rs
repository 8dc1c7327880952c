//! HTTP/1.1 over a bare `TcpStream`, for requests no HTTP client library
//! will send (bytes a `HeaderValue` refuses) and for clients that vanish.

#![allow(unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::proxy::Reply;

/// A request head for `method target` with `Host`, `Connection: close`,
/// the given header lines (raw bytes, written as is) and `body`.
pub fn request(method: &str, target: &str, header_lines: &[&[u8]], body: &[u8]) -> Vec<u8> {
    let mut out =
        format!("{method} {target} HTTP/1.1\r\nhost: proxy.test\r\nconnection: close\r\n")
            .into_bytes();
    for line in header_lines {
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    out
}

/// Writes `request` (which should ask for `Connection: close`), reads the
/// whole answer until the server closes, and parses it.
pub async fn exchange(addr: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr)
        .await
        .expect("connect to the proxy");
    stream.write_all(request).await.expect("write the request");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut raw))
        .await
        .expect("the proxy answers and closes within 20 s")
        .expect("read the answer");
    parse(&raw)
}

/// Parses one HTTP/1.1 response (Content-Length, chunked, or until close).
pub fn parse(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..split]).expect("response head is text");
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let code: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("status line: {status_line:?}"));
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':').expect("header line");
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).expect("header name"),
            HeaderValue::from_str(value.trim()).expect("header value"),
        );
    }
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let body = if chunked {
        dechunk(rest)
    } else if let Some(len) = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        rest[..len.min(rest.len())].to_vec()
    } else {
        rest.to_vec()
    };
    Reply {
        status: StatusCode::from_u16(code).expect("status code"),
        headers,
        body: Bytes::from(body),
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = std::str::from_utf8(&data[..eol]).expect("chunk size is text");
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).expect("chunk size is hex");
        data = &data[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}
