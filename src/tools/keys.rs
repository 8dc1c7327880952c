//! `idemproxy keys`: the admin API's key reconciliation from a shell.
//!
//! Talks to a running proxy's admin listener (`--admin`, default
//! `http://127.0.0.1:9090`) with the token from `IDEMPROXY_ADMIN_TOKEN`
//! (an environment variable, never a flag: flags show in process lists).
//! Every call is the admin API's own (`GET /v1/keys?state=…`,
//! `GET /v1/keys/{hash}`, `POST /v1/keys/lookup`, `POST
//! /v1/keys/reconcile`, `DELETE
//! /v1/keys/{hash}`), so the CLI and a script using the API see the same
//! answers, and the store's own rules (a running claim is not deleted
//! unless forced) hold for both.

use std::io::IsTerminal;
use std::time::Duration;

use bytes::Bytes;
use clap::{Args, Subcommand};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use crate::Error;

/// How long one admin call may take: a bounded walk of the store is the
/// longest.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The environment variable the token is read from.
pub const TOKEN_VARIABLE: &str = "IDEMPROXY_ADMIN_TOKEN";

/// An answer of the admin API other than a success: its problem type's
/// last segment (`record-unreadable`), and what it said (status first).
#[derive(Debug)]
pub struct Refused {
    pub slug: String,
    message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refused {}

/// Whether `error` is the admin API's answer of problem type `slug`.
fn is_refused(error: &Error, slug: &str) -> bool {
    error
        .downcast_ref::<Refused>()
        .is_some_and(|refused| refused.slug == slug)
}

/// A client of one proxy's admin API.
#[derive(Debug)]
pub struct AdminClient {
    base: String,
    token: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// Which keys `keys list` asks for.
#[derive(Clone, Debug)]
pub struct ListFilter {
    /// `pending`, `outcome-unknown`, `completed` or `any`.
    pub state: String,
    /// Only keys created at least this long ago (`10m`).
    pub older_than: Option<String>,
    /// At most this many.
    pub limit: usize,
}

impl AdminClient {
    /// A client of the admin API at `base` (`http://host:port`), with
    /// `token` (usually [`TOKEN_VARIABLE`]'s value).
    pub fn new(base: &str, token: Option<String>) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            token,
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// The keys `filter` selects, following the API's pages until `limit`
    /// are found or the walk is over.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<Value>, Error> {
        self.list_with(filter, |_, _| {}).await
    }

    /// [`AdminClient::list`], telling `on_page` after each page how many
    /// records it examined and how many keys are found so far.
    pub async fn list_with(
        &self,
        filter: &ListFilter,
        mut on_page: impl FnMut(u64, usize),
    ) -> Result<Vec<Value>, Error> {
        let mut keys = Vec::new();
        let mut cursor: Option<String> = None;
        // A Redis Cluster's primaries changed under the walk (a failover):
        // it cannot go on without passing over records, so it starts again,
        // a few times at most.
        let mut restarts = 0;
        loop {
            let mut query = form_urlencoded::Serializer::new(String::new());
            query.append_pair("state", &filter.state);
            query.append_pair("limit", &(filter.limit - keys.len()).to_string());
            if let Some(older_than) = &filter.older_than {
                query.append_pair("older_than", older_than);
            }
            if let Some(cursor) = &cursor {
                query.append_pair("cursor", cursor);
            }
            let page = match self
                .call(Method::GET, &format!("/v1/keys?{}", query.finish()), None)
                .await
            {
                Err(e) if restarts < 3 && is_refused(&e, "walk-interrupted") => {
                    restarts += 1;
                    (keys, cursor) = (Vec::new(), None);
                    continue;
                }
                page => page?,
            };
            if let Some(found) = page["keys"].as_array() {
                keys.extend(found.iter().cloned());
            }
            on_page(page["examined"].as_u64().unwrap_or(0), keys.len());
            match page["next_cursor"].as_str() {
                Some(next) if keys.len() < filter.limit => cursor = Some(next.to_owned()),
                _ => break,
            }
        }
        keys.truncate(filter.limit);
        Ok(keys)
    }

    /// The record of the key whose hash is `hash`.
    pub async fn show(&self, hash: &str) -> Result<Value, Error> {
        self.call(Method::GET, &format!("/v1/keys/{}", hash_path(hash)?), None)
            .await
    }

    /// The record of the raw key `key` as a client sent it on `route`
    /// (default `default`), with the scope `headers` the client sent.
    pub async fn lookup(
        &self,
        key: &str,
        route: Option<&str>,
        headers: &[(String, String)],
    ) -> Result<Value, Error> {
        let headers: serde_json::Map<String, Value> = headers
            .iter()
            .map(|(name, value)| (name.clone(), Value::from(value.as_str())))
            .collect();
        let mut body = json!({ "key": key, "headers": headers });
        if let Some(route) = route {
            body["route"] = Value::from(route);
        }
        self.call(Method::POST, "/v1/keys/lookup", Some(body)).await
    }

    /// Reconciles the raw key `key` with the upstream's lookup
    /// (`reconcile_url`), given the request as the client sent it
    /// (`request`): the proxy holds it to the key's record by its
    /// fingerprint, and fills the lookup's template from it.
    pub async fn reconcile(&self, key: &str, request: &SentRequest) -> Result<Value, Error> {
        let headers: serde_json::Map<String, Value> = request
            .headers
            .iter()
            .map(|(name, value)| (name.clone(), Value::from(value.as_str())))
            .collect();
        let mut call = json!({
            "key": key,
            "headers": headers,
            "method": request.method,
            "path": request.path,
        });
        if let Some(route) = &request.route {
            call["route"] = Value::from(route.as_str());
        }
        if let Some(body) = &request.body {
            call["body_text"] = Value::from(body.as_str());
        }
        if let Some(query) = &request.query {
            call["query"] = Value::from(query.as_str());
        }
        self.call(Method::POST, "/v1/keys/reconcile", Some(call))
            .await
    }

    /// Deletes the record of `hash`; a running claim only with `force`.
    pub async fn forget(&self, hash: &str, force: bool) -> Result<Value, Error> {
        let query = if force { "?force=true" } else { "" };
        self.call(
            Method::DELETE,
            &format!("/v1/keys/{}{query}", hash_path(hash)?),
            None,
        )
        .await
    }

    /// One call; a problem+json answer becomes an error carrying its
    /// detail.
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<Value, Error> {
        let url = format!("{}{path}", self.base);
        let mut request = Request::builder().method(method).uri(&url);
        if let Some(token) = &self.token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match body {
            Some(body) => {
                request = request.header(http::header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(body.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let request = request
            .body(body)
            .map_err(|e| format!("{url} is not a usable admin URL: {e}"))?;
        let response = tokio::time::timeout(CALL_TIMEOUT, self.client.request(request))
            .await
            .map_err(|_| format!("{url}: no answer within {CALL_TIMEOUT:?}"))?
            .map_err(|e| format!("{url}: {e} (is the proxy's admin listener there?)"))?;
        let status = response.status();
        let bytes = tokio::time::timeout(CALL_TIMEOUT, response.into_body().collect())
            .await
            .map_err(|_| format!("{url}: the answer did not finish within {CALL_TIMEOUT:?}"))?
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        let value: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::from(String::from_utf8_lossy(&bytes).trim().to_owned()));
        if status.is_success() {
            return Ok(value);
        }
        let detail = value["detail"].as_str().unwrap_or_default();
        let hint = if status == StatusCode::UNAUTHORIZED && self.token.is_none() {
            format!(" (set {TOKEN_VARIABLE} to the proxy's admin_token)")
        } else {
            String::new()
        };
        let slug = value["type"].as_str().unwrap_or_default();
        Err(Box::new(Refused {
            slug: slug
                .rsplit([':', '/'])
                .next()
                .unwrap_or_default()
                .to_owned(),
            message: format!("{status}: {detail}{hint}"),
        }))
    }
}

fn hash_path(hash: &str) -> Result<&str, Error> {
    if hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(hash)
    } else {
        Err("a key hash is 64 hex digits (the key_hash of the request log)".into())
    }
}

/// A record as `keys show` prints it: one `field: value` per line.
pub fn render_record(record: &Value) -> String {
    let mut out = String::new();
    if let Some(fields) = record.as_object() {
        for (name, value) in fields {
            let value = match value {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            out.push_str(&format!("{name}: {value}\n"));
        }
    }
    out
}

/// A request as its client sent it, for `keys reconcile`.
#[derive(Debug, Clone)]
pub struct SentRequest {
    /// The route whose rules apply (default: `default`).
    pub route: Option<String>,
    pub method: String,
    /// The path, with its query if it had one.
    pub path: String,
    /// The query, when `path` is given without it.
    pub query: Option<String>,
    /// `(name, value)`: the scope's headers, `content-type`, the route's
    /// `fingerprint_headers`, and those `reconcile_url` names.
    pub headers: Vec<(String, String)>,
    /// The body, exactly as sent.
    pub body: Option<String>,
}

/// `keys reconcile`'s account of the request, as its client sent it.
#[derive(Debug, Args)]
pub struct SentFlags {
    /// The route whose scope rules and reconcile_url apply (default:
    /// default).
    #[arg(long)]
    route: Option<String>,
    /// The request's method, as the client sent it.
    #[arg(long, default_value = "POST")]
    method: String,
    /// The request's path (with its query), as the client sent it: the
    /// request must fingerprint to the key's record, or nothing is looked
    /// up or changed.
    #[arg(long)]
    path: String,
    /// A header as the client sent it, `name: value` (repeatable): the
    /// scope's, content-type, the route's fingerprint_headers, and those
    /// reconcile_url names.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// The request's body, exactly as sent (a file, or - for stdin).
    #[arg(long)]
    body: Option<std::path::PathBuf>,
    /// The request's query string (`a=b&c=d`), when --path has none.
    #[arg(long)]
    query: Option<String>,
}

impl SentFlags {
    /// The request, its headers parsed and its body read.
    fn read(&self) -> Result<SentRequest, Error> {
        Ok(SentRequest {
            route: self.route.clone(),
            method: self.method.clone(),
            path: self.path.clone(),
            query: self.query.clone(),
            headers: parse_headers(&self.headers)?,
            body: self.body.as_deref().map(read_body).transpose()?,
        })
    }
}

/// What `keys reconcile` found, as it prints it.
pub fn render_reconciled(answer: &Value) -> String {
    let text = |field: &str| answer[field].as_str().unwrap_or("-").to_owned();
    match answer["result"].as_str() {
        Some("found") => {
            let mut out = format!(
                "found: the upstream answered {} ({} bytes); stored as the key's outcome, replayed to every retry (Idempotency-Reconciled: true)\n",
                answer["status"], answer["body_bytes"]
            );
            let body = text("body");
            if !body.is_empty() {
                let summary: String = body.chars().take(200).collect();
                out.push_str(&format!("body: {summary}\n"));
            }
            out
        }
        Some("absent") => "absent: the operation never happened upstream; the key is free: the next retry executes\n".to_owned(),
        Some("failed") => format!(
            "failed: {}; the key stays outcome-unknown\n",
            text("why")
        ),
        _ => format!("unchanged: {}\n{}", text("detail"), render_record(answer)),
    }
}

/// Records as `keys list` prints them: a header, then one line each.
pub fn render_list(records: &[Value]) -> String {
    let mut out = format!(
        "{:<64}  {:<10}  {:<24}  {}\n",
        "KEY_HASH", "STATE", "CREATED_AT", "OUTCOME"
    );
    for record in records {
        let text = |field: &str| record[field].as_str().unwrap_or("-").to_owned();
        let outcome = match record["state"].as_str() {
            Some("pending") => format!("lease until {}", text("lease_expires_at")),
            Some("unreadable") => text("error"),
            // A listing shows a response's status only where the record
            // holds it in the clear (not packed or sealed).
            _ if record["status"].is_null() => text("outcome"),
            _ => format!("{} ({})", text("outcome"), record["status"]),
        };
        out.push_str(&format!(
            "{:<64}  {:<10}  {:<24}  {outcome}\n",
            text("key_hash"),
            text("state"),
            text("created_at"),
        ));
    }
    let plural = if records.len() == 1 { "" } else { "s" };
    out.push_str(&format!("{} key{plural}\n", records.len()));
    out
}

/// `idemproxy keys`: what an operator asks of the admin key API.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List the keys in a state (a bounded walk of the store: Redis SCAN,
    /// never KEYS).
    List {
        /// pending, outcome-unknown, completed or any.
        #[arg(long, default_value = "outcome-unknown")]
        state: String,
        /// Only keys created at least this long ago (10m, 2h).
        #[arg(long)]
        older_than: Option<String>,
        /// At most this many keys.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[command(flatten)]
        admin: AdminFlags,
    },
    /// Show a key's record: by its hash (the request log's key_hash), or
    /// by the raw key as a client sent it.
    Show {
        /// The key's hash: the request log's key_hash (64 hex digits).
        #[arg(long, required_unless_present = "key", conflicts_with = "key")]
        hash: Option<String>,
        /// The raw Idempotency-Key value.
        #[arg(long)]
        key: Option<String>,
        /// The route whose scope rules apply (default: default).
        #[arg(long, requires = "key")]
        route: Option<String>,
        /// A scope header as the client sent it, `name: value`
        /// (repeatable), e.g. --header 'authorization: Bearer sk_…'.
        #[arg(long = "header", requires = "key")]
        headers: Vec<String>,
        #[command(flatten)]
        admin: AdminFlags,
    },
    /// Ask the upstream's lookup (the route's reconcile_url) what became
    /// of a key whose outcome is unknown, and settle it by the answer:
    /// found, stored and replayed; absent, freed for the next retry;
    /// anything else, left outcome-unknown.
    Reconcile {
        /// The raw Idempotency-Key value.
        #[arg(long)]
        key: String,
        #[command(flatten)]
        request: SentFlags,
        #[command(flatten)]
        admin: AdminFlags,
    },
    /// Forget a key so that its retry executes: only once its effect was
    /// checked with the upstream. Asks first on a terminal.
    Forget {
        /// The key's hash, as `keys list` shows it.
        #[arg(long)]
        hash: String,
        /// Also a claim whose lease runs (a request may be executing it).
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        admin: AdminFlags,
    },
}

/// Where the admin API is, and how to print its answers.
#[derive(Debug, Args)]
pub struct AdminFlags {
    /// The proxy's admin listener.
    #[arg(
        long = "admin",
        default_value = "http://127.0.0.1:9090",
        env = "IDEMPROXY_ADMIN_URL"
    )]
    pub admin_url: String,
    /// JSON for scripts instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs one `idemproxy keys` command against the admin API.
pub async fn run(command: &KeysCommand) -> Result<(), Error> {
    let admin = match command {
        KeysCommand::List { admin, .. }
        | KeysCommand::Show { admin, .. }
        | KeysCommand::Reconcile { admin, .. }
        | KeysCommand::Forget { admin, .. } => admin,
    };
    let token = std::env::var(TOKEN_VARIABLE).ok();
    let client = AdminClient::new(&admin.admin_url, token);
    let print = |value: &serde_json::Value, text: String| {
        if admin.json {
            println!("{value}");
        } else {
            print!("{text}");
        }
    };
    match command {
        KeysCommand::List {
            state,
            older_than,
            limit,
            ..
        } => {
            let filter = ListFilter {
                state: state.clone(),
                older_than: older_than.clone(),
                limit: (*limit).max(1),
            };
            let mut progress = super::progress::Progress::new("keys list");
            let listed = client
                .list_with(&filter, |examined, found| {
                    progress.advance(examined, format_args!("{found} listed"));
                })
                .await;
            progress.finish();
            let keys = listed?;
            print(&serde_json::Value::from(keys.clone()), render_list(&keys));
        }
        KeysCommand::Show {
            hash,
            key,
            route,
            headers,
            ..
        } => {
            let record = match (hash, key) {
                (Some(hash), _) => client.show(hash).await?,
                (None, Some(key)) => {
                    let headers = parse_headers(headers)?;
                    client.lookup(key, route.as_deref(), &headers).await?
                }
                (None, None) => return Err("give --hash or --key".into()),
            };
            print(&record, render_record(&record));
        }
        KeysCommand::Reconcile { key, request, .. } => {
            let answer = client.reconcile(key, &request.read()?).await?;
            print(&answer, render_reconciled(&answer));
        }
        KeysCommand::Forget {
            hash, force, yes, ..
        } => {
            let forgotten = forget(&client, hash, *force, *yes).await?;
            print(&forgotten, format!("forgot {hash}\n"));
        }
    }
    Ok(())
}

/// `keys forget`: reads the record first, so that a hash that names no
/// record says so and the question shows what would be forgotten. A
/// record that does not read is forgotten like any other (it is how an
/// operator clears one); the question then shows why.
async fn forget(
    client: &AdminClient,
    hash: &str,
    force: bool,
    yes: bool,
) -> Result<serde_json::Value, Error> {
    let shown = match client.show(hash).await {
        Ok(record) => render_record(&record),
        Err(e) if is_refused(&e, "record-unreadable") => format!("{e}\n"),
        Err(e) => return Err(e),
    };
    if !yes && std::io::stdin().is_terminal() {
        eprint!("{shown}Forget this key? Its next retry will execute the request again. [y/N] ");
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            return Err("not forgotten".into());
        }
    }
    client.forget(hash, force).await
}

/// `--body FILE` (or `-`, stdin): the request's JSON body.
/// The body of `--body`, exactly as written: it is fingerprinted, and a
/// `{json:...}` number is looked up as written.
fn read_body(path: &std::path::Path) -> Result<String, Error> {
    if path.as_os_str() == "-" {
        return Ok(std::io::read_to_string(std::io::stdin())?);
    }
    std::fs::read_to_string(path).map_err(|e| format!("--body {}: {e}", path.display()).into())
}

/// `--header "name: value"` options, as (name, value) pairs.
fn parse_headers(headers: &[String]) -> Result<Vec<(String, String)>, Error> {
    headers
        .iter()
        .map(|header| {
            header
                .split_once(':')
                .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
                .ok_or_else(|| format!("--header {header:?}: expected `name: value`").into())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_record_is_printed_with_why() {
        let hash = "ab".repeat(32);
        let text = render_list(&[
            serde_json::json!({"key_hash": hash, "state": "unreadable", "error": "the value is not a record"}),
            serde_json::json!({"key_hash": "cd".repeat(32), "state": "completed", "created_at": "2026-12-03T15:00:00Z", "outcome": "outcome-unknown (timeout)", "status": 504}),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(
            lines[1].starts_with(&hash)
                && lines[1].contains("unreadable")
                && lines[1].ends_with("the value is not a record"),
            "{text}"
        );
        assert!(
            lines[2].ends_with("outcome-unknown (timeout) (504)"),
            "{text}"
        );
        // The columns line up: every state is as wide as the header's.
        let outcome_at = lines[0].find("OUTCOME").expect("header");
        assert_eq!(lines[2].find("outcome-unknown"), Some(outcome_at), "{text}");
        assert_eq!(lines[3], "2 keys");
    }
}
