//! Reading and writing a route's shared tool catalog record (see
//! [`SharedCatalog`](super::mcp_catalog::SharedCatalog)): consulted before a call of a tool this process
//! does not know, written after a listing taught it something.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::layer::Settings;
use super::policy::McpRoute;
use crate::core::{CompletedRecord, Outcome, Record, Removal, StoredResponse};
use crate::store::fixed_record::{self, Written};

/// How long the shared record lives after it last changed: any listing
/// after that writes it again.
const SHARED_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Before deciding how calls of `name` are protected: when no listing
/// through this process named it, learns what the shared record says
/// (at most once per `REFRESH`). A store that does not answer leaves
/// the tool unknown, and so protected.
pub(super) async fn consult_shared_catalog(
    settings: &Settings,
    route: &McpRoute,
    name: Option<&str>,
) {
    if name.is_some_and(|name| route.catalog.knows(name)) || !route.shared.take_read() {
        return;
    }
    let read = settings.store.get(&route.shared.key);
    let record = match tokio::time::timeout(settings.store_timeout, read).await {
        Ok(Ok(record)) => record,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "the shared tool catalog could not be read");
            return;
        }
        Err(_) => return,
    };
    if let Some(Record::Completed(CompletedRecord {
        outcome: Outcome::Response(stored),
        ..
    })) = record
    {
        route.catalog.learn_shared(&stored.body);
    }
}

/// After a listing: shares the route's catalog when the listing taught it
/// something since revision `before` (in a task of its own: the answer
/// does not wait).
pub(super) fn share_catalog_after(settings: &Arc<Settings>, route: &Arc<McpRoute>, before: u64) {
    if route.catalog.revision() == before {
        return;
    }
    let settings = settings.clone();
    let route = route.clone();
    let tasks = settings.tasks.clone();
    tokio::spawn(tasks.track_future(async move {
        share_catalog(&settings, &route).await;
    }));
}

/// Writes the route's catalog, merged with what the record holds, as the
/// record; leaves it alone when it already says the same.
async fn share_catalog(settings: &Settings, route: &McpRoute) {
    let store = &settings.store;
    let timeout = settings.store_timeout;
    let key = route.shared.key;
    if let Ok(Ok(Some(Record::Completed(CompletedRecord {
        outcome: Outcome::Response(stored),
        ..
    })))) = tokio::time::timeout(timeout, store.get(&key)).await
    {
        route.catalog.learn_shared(&stored.body);
    }
    let response = StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from(route.catalog.to_shared()),
    };
    // A changed catalog meets the old record as another body: removed,
    // then written on the second pass.
    for _ in 0..2 {
        let now = settings.clock.now_millis();
        let written = fixed_record::write(
            store.as_ref(),
            key,
            response.clone(),
            SHARED_TTL,
            now,
            timeout,
        )
        .await;
        if !matches!(written, Written::Other) {
            return;
        }
        let remove = store.remove(&key, Removal::UnlessLeased);
        if !matches!(tokio::time::timeout(timeout, remove).await, Ok(Ok(_))) {
            return;
        }
    }
}
