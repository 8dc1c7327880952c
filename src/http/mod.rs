//! What every HTTP answer of the proxy shares: the header names it reads
//! and writes ([`headers`]) and the one `application/problem+json` renderer
//! ([`problem`]) behind the proxy's rejections and the admin API's errors
//! alike.

pub mod headers;
pub mod problem;

pub use problem::{Problem, PROBLEM_BASE};
