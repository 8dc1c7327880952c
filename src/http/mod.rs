//! What every HTTP answer of the proxy shares: the header names it reads
//! and writes ([`headers`]) and the one `application/problem+json` renderer
//! ([`problem`]) behind the proxy's rejections and the admin API's errors
//! alike, and what a connection's peer proved ([`peer`]).

pub(crate) mod headers;
pub(crate) mod peer;
pub(crate) mod problem;

pub(crate) use peer::ClientCertificate;
pub(crate) use problem::Problem;
