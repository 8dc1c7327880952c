//! Parsing a body into a [`Document`]: serde_json validates and tokenizes,
//! and the visitors here append each value to the tape where it goes,
//! sorting each object's members once, as it closes, which is also where
//! duplicate names show up.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::{name_at, utf16_cmp, Document, Entry};

impl<'a> Document<'a> {
    /// Parses `body` as I-JSON (RFC 7493): JSON text that serde_json
    /// accepts, without duplicate object names (parsers disagree on which
    /// one wins) and without numbers beyond the double range. Integers a
    /// double cannot hold exactly (beyond ±2^53, see [`EXACT_INTEGERS`]) are
    /// kept apart: see [`Document::is_exact`].
    pub(crate) fn parse(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        let mut builder = Builder {
            // Guesses that save typical bodies most of the regrowing.
            tape: Vec::with_capacity(body.len() / 8),
            names: Vec::with_capacity(16),
            order: Vec::with_capacity(body.len() / 16),
            inexact: false,
        };
        // Validated as UTF-8 once, whole: read from a `str`, serde_json
        // takes its strings as they are, where from a slice it validates
        // each one again (a seventh of the parse). A body that is not
        // UTF-8 is not JSON text either (RFC 8259 section 8.1).
        let text = std::str::from_utf8(body).map_err(de::Error::custom)?;
        let mut de = serde_json::Deserializer::from_str(text);
        EntrySeed(&mut builder).deserialize(&mut de)?;
        // What `serde_json::from_slice` does after the value: only
        // whitespace may follow.
        de.end()?;
        Ok(Document {
            tape: builder.tape,
            order: builder.order,
            inexact: builder.inexact,
        })
    }
}

/// The document being parsed, plus the names of the objects still open
/// (one stack for all of them, so no object allocates its own).
struct Builder<'de> {
    tape: Vec<Entry<'de>>,
    names: Vec<usize>,
    order: Vec<usize>,
    /// Whether an [`Entry::Inexact`] was pushed.
    inexact: bool,
}

impl<'de> Builder<'de> {
    fn set(&mut self, at: usize, entry: Entry<'de>) {
        if let Some(slot) = self.tape.get_mut(at) {
            *slot = entry;
        }
    }
}

/// Appends a value to the tape rather than returning it: moving an entry
/// out of every nested call costs more than pushing it where it goes.
struct EntrySeed<'b, 'de>(&'b mut Builder<'de>);

impl<'de> EntrySeed<'_, 'de> {
    fn push<E>(self, entry: Entry<'de>) -> Result<(), E> {
        self.0.tape.push(entry);
        Ok(())
    }

    /// An integer literal, `value` as the double it reads as: inexact past
    /// [`EXACT_INTEGERS`] in `magnitude`.
    fn push_integer<E>(self, magnitude: u64, value: f64) -> Result<(), E> {
        if magnitude > EXACT_INTEGERS {
            self.0.inexact = true;
            return self.push(Entry::Inexact(value));
        }
        self.push(Entry::Number(value))
    }
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// The largest integer literal read as a number. RFC 8785 reads every
/// number as a double, which holds every integer up to 2^53 and only some
/// past it: `9007199254740993` and `9007199254740992` would fingerprint
/// alike, so the same key with another account number (64-bit ids are
/// common) would be answered with the first request's response instead
/// of 409. I-JSON (RFC 7493 §2.2) leaves such numbers out; like a body
/// with duplicate names, a body with one (outside the ignored members) is
/// hashed as raw bytes, which can only err towards a 409. (Literals beyond
/// 64 bits, and decimals with more than 15 significant digits, still round:
/// serde_json hands them over as doubles already.)
const EXACT_INTEGERS: u64 = 1 << 53;

impl<'de> Visitor<'de> for EntrySeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.push(Entry::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.push_integer(v.unsigned_abs(), v as f64)
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.push_integer(v, v as f64)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        if v.is_finite() {
            self.push(Entry::Number(v))
        } else {
            Err(E::custom("number out of range"))
        }
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<(), E> {
        self.push(Entry::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.push(Entry::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<(), E> {
        self.push(Entry::String(Cow::Owned(v)))
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.push(Entry::Null)
    }

    fn visit_none<E>(self) -> Result<(), E> {
        self.push(Entry::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let head = self.0.tape.len();
        self.0.tape.push(Entry::Array { end: head });
        while seq.next_element_seed(EntrySeed(&mut *self.0))?.is_some() {}
        let end = self.0.tape.len();
        self.0.set(head, Entry::Array { end });
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let head = self.0.tape.len();
        self.0.tape.push(Entry::Object {
            end: head,
            first: 0,
            len: 0,
        });
        let open = self.0.names.len();
        loop {
            let at = self.0.tape.len();
            if map.next_key_seed(NameSeed(&mut *self.0))?.is_none() {
                break;
            }
            self.0.names.push(at);
            map.next_value_seed(EntrySeed(&mut *self.0))?;
        }
        let Builder {
            tape, names, order, ..
        } = &mut *self.0;
        let own = names.get_mut(open..).unwrap_or_default();
        own.sort_unstable_by(|&a, &b| utf16_cmp(name_at(tape, a), name_at(tape, b)));
        if own
            .iter()
            .zip(own.iter().skip(1))
            .any(|(&a, &b)| name_at(tape, a) == name_at(tape, b))
        {
            return Err(de::Error::custom("duplicate object key"));
        }
        let (first, len) = (order.len(), own.len());
        order.extend_from_slice(own);
        names.truncate(open);
        let end = tape.len();
        self.0.set(head, Entry::Object { end, first, len });
        Ok(())
    }
}

/// An object member's name, appended to the tape like a string value.
struct NameSeed<'b, 'de>(&'b mut Builder<'de>);

impl<'de> DeserializeSeed<'de> for NameSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<(), E> {
        EntrySeed(self.0).push(Entry::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        EntrySeed(self.0).push(Entry::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<(), E> {
        EntrySeed(self.0).push(Entry::String(Cow::Owned(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::jcs::tests::canonical;

    #[test]
    fn integer_literals_a_double_cannot_hold_are_not_i_json() {
        // 2^53 and below: every integer is a double of its own.
        assert_eq!(
            canonical("[9007199254740992, -9007199254740992, 9007199254740991]"),
            "[9007199254740992,-9007199254740992,9007199254740991]"
        );
        // Past it, 2^53 + 1 would read as 2^53: not I-JSON, so hashed raw.
        for text in [
            "9007199254740993",
            "-9007199254740993",
            r#"{"to_account": 18446744073709551615}"#,
            "[-9223372036854775808]",
        ] {
            let doc = Document::parse(text.as_bytes()).expect(text);
            assert!(!doc.is_exact(), "{text}");
        }
        assert!(Document::parse(b"[1, 2.5, {\"a\": -9007199254740992}]")
            .expect("JSON")
            .is_exact());
        // Written as a double, the sender chose a double.
        assert_eq!(
            canonical("[9007199254740993.0, 1e21]"),
            "[9007199254740992,1e+21]"
        );
    }

    #[test]
    fn duplicate_names_are_rejected_however_spelled() {
        for json in [
            r#"{"a":1,"a":1}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"b":0,"😀":1,"a":2,"\ud83d\ude00":3}"#,
            r#"[{"x":{"k":[],"k":{}}}]"#,
        ] {
            assert!(Document::parse(json.as_bytes()).is_err(), "{json}");
        }
    }

    #[test]
    fn strings_borrow_unless_escaped() {
        let doc = Document::parse(br#"{"plain":"text","\u0065sc":"t\u0065xt"}"#).expect("JSON");
        assert!(matches!(
            doc.tape.as_slice(),
            [
                Entry::Object { .. },
                Entry::String(Cow::Borrowed("plain")),
                Entry::String(Cow::Borrowed("text")),
                Entry::String(Cow::Owned(esc)),
                Entry::String(Cow::Owned(_)),
            ] if esc == "esc"
        ));
    }
}
