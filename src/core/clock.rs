//! Time as records count it: wall-clock milliseconds since the Unix epoch,
//! read from an injected [`Clock`] so that leases and expiry can be tested
//! with paused time instead of sleeps.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch. Records use wall-clock time because they
/// are shared by processes (restarts of the embedded store, replicas on Redis).
pub type UnixMillis = u64;

pub fn now_millis() -> UnixMillis {
    to_millis(SystemTime::now())
}

pub fn to_millis(t: SystemTime) -> UnixMillis {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The last millisecond of the year 9999: HTTP and RFC 3339 dates end
/// there, and their formatters (`httpdate`, `humantime`) panic past it.
pub const LAST_DATE_MILLIS: UnixMillis = 253_402_300_799_999;

/// The instant `ms` stands for, for display: capped at
/// [`LAST_DATE_MILLIS`], which only a corrupt or foreign record goes past
/// (`ttl` is at most a year).
pub fn from_millis(ms: UnixMillis) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.min(LAST_DATE_MILLIS))
}

pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_instant_formats_as_a_date() {
        for ms in [
            0,
            1_764_633_600_000,
            LAST_DATE_MILLIS,
            LAST_DATE_MILLIS + 1,
            u64::MAX,
        ] {
            let http = httpdate::fmt_http_date(from_millis(ms));
            let rfc3339 = humantime::format_rfc3339_millis(from_millis(ms)).to_string();
            if ms >= LAST_DATE_MILLIS {
                assert_eq!(http, "Fri, 31 Dec 9999 23:59:59 GMT");
                assert_eq!(rfc3339, "9999-12-31T23:59:59.999Z");
            }
        }
    }
}
