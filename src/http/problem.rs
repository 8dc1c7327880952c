//! RFC 9457 problem details: every error the proxy itself produces, on the
//! traffic listener and the admin listener alike, is one of these.

use axum::body::Body;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use serde::Serialize;

/// Problem types are URNs (RFC 9457 allows any URI): stable names that need
/// no web server. Each slug is documented in docs/contract.md.
pub(crate) const PROBLEM_BASE: &str = "urn:idemproxy:problem:";

/// One problem document: `type` (from its slug), `title`, `status`,
/// `detail` and, where the answer concerns a key, the key's state.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    detail: String,
    key_status: Option<&'static str>,
}

#[derive(Serialize)]
struct Document<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    key_status: Option<&'static str>,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        slug: &'static str,
        title: &'static str,
        detail: String,
    ) -> Self {
        Self {
            status,
            slug,
            title,
            detail,
            key_status: None,
        }
    }

    /// The state of the key the answer concerns (`pending`, `completed`,
    /// `released`).
    pub(crate) fn key_status(mut self, key_status: Option<&'static str>) -> Self {
        self.key_status = key_status;
        self
    }

    pub(crate) fn into_response(self) -> Response<Body> {
        let document = Document {
            kind: format!("{PROBLEM_BASE}{}", self.slug),
            title: self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
            key_status: self.key_status,
        };
        // Plain strings and numbers: serializing cannot fail.
        let body = serde_json::to_vec(&document).unwrap_or_default();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}
