//! Time as records count it: wall-clock milliseconds since the Unix epoch,
//! read from an injected [`Clock`] so that leases and expiry can be tested
//! with paused time instead of sleeps.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where the stores and the middleware read the time that records carry
/// (`created_at`, leases, expiry). Records use wall-clock time because
/// they are shared by processes: restarts of the embedded store, replicas
/// on Redis. Cheap to copy.
///
/// [`Clock::wall`] in production. `Clock::tokio` (with this crate's
/// `tokio` feature, which the proxy turns on) follows tokio's clock from
/// the wall time at which it was made: under `tokio::time::pause()` it
/// stands still until the test advances it, together with every sleep and
/// timeout of the request path, so a lease can run out without waiting
/// for it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Clock(Source);

#[derive(Clone, Copy, Debug, Default)]
enum Source {
    #[default]
    Wall,
    #[cfg(feature = "tokio")]
    Tokio {
        origin_millis: UnixMillis,
        origin: tokio::time::Instant,
    },
}

impl Clock {
    /// The system's wall clock.
    pub fn wall() -> Self {
        Self(Source::Wall)
    }

    /// Wall time now, advancing as tokio's clock does from here on.
    #[cfg(feature = "tokio")]
    pub fn tokio() -> Self {
        Self(Source::Tokio {
            origin_millis: now_millis(),
            origin: tokio::time::Instant::now(),
        })
    }

    /// `origin_millis` now, advancing as tokio's clock does from here on:
    /// for a test that reads records written at a known instant (a fixture
    /// from an earlier build) as if it were then.
    #[cfg(feature = "tokio")]
    pub fn tokio_from(origin_millis: UnixMillis) -> Self {
        Self(Source::Tokio {
            origin_millis,
            origin: tokio::time::Instant::now(),
        })
    }

    /// Milliseconds since the Unix epoch, now.
    pub fn now_millis(&self) -> UnixMillis {
        match self.0 {
            Source::Wall => now_millis(),
            #[cfg(feature = "tokio")]
            Source::Tokio {
                origin_millis,
                origin,
            } => origin_millis.saturating_add(millis(origin.elapsed())),
        }
    }
}

/// Milliseconds since the Unix epoch. Records use wall-clock time because they
/// are shared by processes (restarts of the embedded store, replicas on Redis).
pub type UnixMillis = u64;

/// The wall clock, read directly: for what is not a record's time (a log
/// line, an admin answer). Records take theirs from a [`Clock`].
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

    #[cfg(feature = "tokio")]
    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_only_with_tokio_time() {
        let clock = Clock::tokio();
        let start = clock.now_millis();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(clock.now_millis(), start, "paused time stands still");
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.now_millis(), start + 90_000);
        let wall = Clock::wall().now_millis();
        assert!(wall.abs_diff(start) < 60_000, "it starts at wall time");
    }

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
