//! [`ByteString`]: bytes that are usually text, carried in JSON without losing a byte.
//!
//! Linux argument vectors, environment values and file names are byte strings: nothing makes
//! them UTF-8 (`printf '%s' $'\xff'` is a valid command). JSON strings are Unicode, so a
//! `ByteString` is written as a plain JSON string when its bytes are valid UTF-8 (what almost
//! every value is, and what older peers send) and as `{"base64": "..."}` (RFC 4648 §4, with
//! padding) otherwise. Readers accept both forms for any value.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use base64::Engine as _;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The key of the object form, `{"base64": "..."}`.
pub const BASE64_KEY: &str = "base64";

/// An owned byte string (argv entry, `KEY=VALUE` environment entry, path) that round-trips
/// through JSON byte for byte; see the [module docs](self) for the two encodings.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteString(Vec<u8>);

impl ByteString {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The bytes, as an OS string (what `exec` and `open` take on Unix).
    pub fn as_os_str(&self) -> &OsStr {
        OsStr::from_bytes(&self.0)
    }

    /// The bytes as `&str` when they are valid UTF-8.
    pub fn to_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// The bytes as text, with each invalid UTF-8 sequence replaced by U+FFFD (for messages
    /// and logs only, never to act on).
    pub fn to_string_lossy(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.0)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The owned bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for ByteString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_str() {
            Some(text) => fmt::Debug::fmt(text, f),
            None => write!(f, "b\"{}\"", self.0.escape_ascii()),
        }
    }
}

/// Shows the bytes lossily (invalid UTF-8 as U+FFFD), for messages.
impl fmt::Display for ByteString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_string_lossy())
    }
}

impl From<Vec<u8>> for ByteString {
    fn from(bytes: Vec<u8>) -> Self {
        ByteString(bytes)
    }
}

impl From<&[u8]> for ByteString {
    fn from(bytes: &[u8]) -> Self {
        ByteString(bytes.to_vec())
    }
}

impl From<String> for ByteString {
    fn from(text: String) -> Self {
        ByteString(text.into_bytes())
    }
}

impl From<&String> for ByteString {
    fn from(text: &String) -> Self {
        ByteString(text.as_bytes().to_vec())
    }
}

impl From<&str> for ByteString {
    fn from(text: &str) -> Self {
        ByteString(text.as_bytes().to_vec())
    }
}

impl From<OsString> for ByteString {
    fn from(text: OsString) -> Self {
        ByteString(text.into_vec())
    }
}

impl From<&OsStr> for ByteString {
    fn from(text: &OsStr) -> Self {
        ByteString(text.as_bytes().to_vec())
    }
}

impl From<ByteString> for OsString {
    fn from(bytes: ByteString) -> Self {
        OsString::from_vec(bytes.0)
    }
}

impl AsRef<OsStr> for ByteString {
    fn as_ref(&self) -> &OsStr {
        self.as_os_str()
    }
}

impl AsRef<[u8]> for ByteString {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl PartialEq<str> for ByteString {
    fn eq(&self, other: &str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl PartialEq<&str> for ByteString {
    fn eq(&self, other: &&str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl Serialize for ByteString {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self.to_str() {
            Some(text) => serializer.serialize_str(text),
            None => {
                let mut map = serializer.serialize_map(Some(1))?;
                let encoded = base64::engine::general_purpose::STANDARD.encode(&self.0);
                map.serialize_entry(BASE64_KEY, &encoded)?;
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for ByteString {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ByteStringVisitor)
    }
}

/// Accepts a JSON string or `{"base64": "..."}` and nothing else.
struct ByteStringVisitor;

impl<'de> Visitor<'de> for ByteStringVisitor {
    type Value = ByteString;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#"a string, or {"base64": "..."} for bytes that are not UTF-8"#)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<ByteString, E> {
        Ok(ByteString::from(text))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<ByteString, E> {
        Ok(ByteString::from(text))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ByteString, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key::<String>()? {
            if key != BASE64_KEY {
                return Err(de::Error::unknown_field(&key, &[BASE64_KEY]));
            }
            if found.is_some() {
                return Err(de::Error::duplicate_field(BASE64_KEY));
            }
            let text: String = map.next_value()?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text.as_bytes())
                .map_err(|e| de::Error::custom(format!("base64 value: {e}")))?;
            found = Some(ByteString(bytes));
        }
        found.ok_or_else(|| de::Error::missing_field(BASE64_KEY))
    }
}

#[cfg(feature = "openapi")]
mod schema {
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Schema, Type};
    use utoipa::openapi::RefOr;

    impl utoipa::PartialSchema for super::ByteString {
        fn schema() -> RefOr<Schema> {
            let text = ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some("The bytes, when they are valid UTF-8"));
            let object = ObjectBuilder::new()
                .schema_type(Type::Object)
                .property(
                    super::BASE64_KEY,
                    ObjectBuilder::new().schema_type(Type::String).format(Some(
                        utoipa::openapi::SchemaFormat::Custom("byte".to_string()),
                    )),
                )
                .required(super::BASE64_KEY)
                .description(Some("Bytes that are not valid UTF-8, base64 (RFC 4648)"));
            RefOr::T(Schema::OneOf(
                OneOfBuilder::new()
                    .item(text)
                    .item(object)
                    .description(Some(
                        "A byte string (argv entry, environment value, path): a JSON string, \
                         or {\"base64\": \"...\"} when it is not UTF-8",
                    ))
                    .build(),
            ))
        }
    }

    impl utoipa::ToSchema for super::ByteString {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_bytes_are_a_plain_json_string() {
        let value = ByteString::from("héllo");

        let json = serde_json::to_string(&value).unwrap();

        assert_eq!(json, r#""héllo""#);
        assert_eq!(serde_json::from_str::<ByteString>(&json).unwrap(), value);
    }

    #[test]
    fn other_bytes_round_trip_as_base64() {
        let value = ByteString::from(vec![b'a', 0xff, 0x00, b'\n']);

        let json = serde_json::to_string(&value).unwrap();

        assert_eq!(json, r#"{"base64":"Yf8ACg=="}"#);
        assert_eq!(serde_json::from_str::<ByteString>(&json).unwrap(), value);
    }

    #[test]
    fn the_object_form_is_accepted_for_text_too() {
        let value: ByteString = serde_json::from_str(r#"{"base64":"aGk="}"#).unwrap();

        assert_eq!(value, "hi");
    }

    #[test]
    fn malformed_values_are_refused_with_a_reason() {
        let cases = [
            (r#"{"base64":"***"}"#, "base64 value"),
            (r#"{"hex":"ff"}"#, "unknown field"),
            (r#"{}"#, "missing field"),
            (r#"{"base64":"aA==","base64":"aA=="}"#, "duplicate field"),
            ("17", "a string, or"),
            (r#"["a"]"#, "a string, or"),
        ];
        for (json, reason) in cases {
            let err = serde_json::from_str::<ByteString>(json).unwrap_err();
            assert!(err.to_string().contains(reason), "{json}: {err}");
        }
    }

    #[test]
    fn debug_shows_text_or_escaped_bytes() {
        assert_eq!(format!("{:?}", ByteString::from("a b")), r#""a b""#);
        assert_eq!(
            format!("{:?}", ByteString::from(vec![0xff, b'x'])),
            r#"b"\xffx""#
        );
    }
}
