//! The one redaction of URLs for anything the proxy prints: errors, logs,
//! and `idemproxy check`'s effective configuration. A URL may carry a
//! secret in its userinfo (`redis://app:password@host`,
//! `https://token@collector`) or in its query (`?token=…`); the printed form
//! keeps where it points and hides what it proves.

/// What replaces a hidden secret.
const REDACTED: &str = "<redacted>";

/// Query parameters whose values are hidden: a name holding any of these
/// (case-insensitive) is taken for a credential.
const SECRET_PARAMS: &[&str] = &[
    "token",
    "key",
    "secret",
    "pass",
    "pwd",
    "auth",
    "sig",
    "credential",
    "session",
];

/// `url` fit to print: a userinfo password hidden (`user:<redacted>@`), a
/// userinfo without one hidden whole (a bare token), and the values of
/// query parameters named like credentials hidden. Text that is not a URL
/// is not shown at all: where a secret would be in it is anyone's guess.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return "<not shown>".into();
    };
    let (scheme, rest) = url.split_at(scheme_end + 3);
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    // The last `@`: a password may hold `/`, `?`, `#` or `@` unescaped,
    // and hiding too much of a URL is safer than hiding too little.
    let after_userinfo = match rest.rfind('@') {
        Some(at) => {
            if let Some(colon) = rest[..at].find(':') {
                out.push_str(&rest[..colon]);
                out.push(':');
            }
            out.push_str(REDACTED);
            out.push('@');
            &rest[at + 1..]
        }
        None => rest,
    };
    let Some(question) = after_userinfo.find('?') else {
        out.push_str(after_userinfo);
        return out;
    };
    out.push_str(&after_userinfo[..=question]);
    let (query, fragment) = match after_userinfo[question + 1..].split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (&after_userinfo[question + 1..], None),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if secret_param(name) => format!("{name}={REDACTED}"),
            _ => pair.to_owned(),
        })
        .collect();
    out.push_str(&pairs.join("&"));
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

fn secret_param(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    SECRET_PARAMS.iter().any(|s| name.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_and_credential_parameters_are_hidden() {
        for (url, shown) in [
            ("redis://u:p@h:1/2", "redis://u:<redacted>@h:1/2"),
            ("rediss://h:1", "rediss://h:1"),
            ("redis://:pw@h", "redis://:<redacted>@h"),
            (
                "https://tok3n@collector:4318",
                "https://<redacted>@collector:4318",
            ),
            (
                "https://c:s3cret@otel:4318/v1/traces?token=abc&service=x#f",
                "https://c:<redacted>@otel:4318/v1/traces?token=<redacted>&service=x#f",
            ),
            (
                "https://otel/v1?API_KEY=1&X-Amz-Signature=2&a=b",
                "https://otel/v1?API_KEY=<redacted>&X-Amz-Signature=<redacted>&a=b",
            ),
            ("idemproxy:S3cret@redis:6379", "<not shown>"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        for url in [
            "https://svc:hun/ter2@api.internal",
            "https://svc:hun?ter2@api.internal",
            "https://svc:hun#ter2@api.internal",
            "https://svc:hun@ter2@api.internal",
        ] {
            assert!(!redact_url(url).contains("ter2"), "{url}");
        }
    }
}
