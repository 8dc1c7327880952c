//! What every HTTP answer of the proxy shares: the header names it reads
//! and writes ([`headers`]) and the one `application/problem+json` renderer
//! ([`problem`]) behind the proxy's rejections and the admin API's errors
//! alike, and what layers hand each other in extensions ([`extensions`]).

pub(crate) mod extensions;
pub(crate) mod headers;
pub(crate) mod problem;

pub(crate) use extensions::CloseDelimited;
pub(crate) use problem::Problem;
