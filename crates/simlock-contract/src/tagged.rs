//! The one reader of a type held as a tag and a payload: an adjacently tagged enum
//! (`#[serde(tag = …, content = …)]`) read as if it were the object `{tag: …, content: …}`,
//! without building that object. A [`Push`](crate::Push) is read from a [`PushFrame`]'s kind and
//! payload (moved), an [`Event`](crate::event::Event) from an
//! [`EventEnvelope`](crate::model::EventEnvelope)'s name and payload (read in place).
//!
//! [`PushFrame`]: crate::PushFrame

use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, StrDeserializer};
use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess};

/// The tag's key and the payload's key of an adjacently tagged type.
pub(crate) type Keys = [&'static str; 2];

/// Reads `T`, tagged under `keys`, from its `tag` and its `payload`: a `&Value` is read in place
/// (the fields `T` keeps are copied out of it), a `Value` is taken apart (its strings, arrays and
/// maps are moved into `T`).
pub(crate) fn read<'de, T, P>(keys: Keys, tag: &str, payload: P) -> Result<T, serde_json::Error>
where
    T: Deserialize<'de>,
    P: Deserializer<'de, Error = serde_json::Error>,
{
    T::deserialize(MapAccessDeserializer::new(Tagged {
        keys,
        tag,
        payload: Some(payload),
        at: 0,
    }))
}

/// A tag and a payload, seen as the two entries of a map.
struct Tagged<'t, P> {
    keys: Keys,
    tag: &'t str,
    payload: Option<P>,
    /// Entries read so far.
    at: usize,
}

impl<'de, P> MapAccess<'de> for Tagged<'_, P>
where
    P: Deserializer<'de, Error = serde_json::Error>,
{
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some(key) = self.keys.get(self.at) else {
            return Ok(None);
        };
        seed.deserialize(StrDeserializer::new(key)).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        self.at += 1;
        if self.at == 1 {
            return seed.deserialize(StrDeserializer::new(self.tag));
        }
        match self.payload.take() {
            Some(payload) => seed.deserialize(payload),
            None => Err(Self::Error::custom("the payload was read already")),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.keys.len().saturating_sub(self.at))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(tag = "kind", content = "body", rename_all = "kebab-case")]
    enum Sample {
        Named { name: String, tags: Vec<String> },
        Empty,
    }

    const KEYS: Keys = ["kind", "body"];

    #[test]
    fn a_tag_and_a_payload_read_alike_in_place_and_moved() {
        let payload = json!({"name": "a", "tags": ["x", "y"], "extra": 1});
        let want = Sample::Named {
            name: "a".into(),
            tags: vec!["x".into(), "y".into()],
        };
        assert_eq!(read::<Sample, _>(KEYS, "named", &payload).unwrap(), want);
        assert_eq!(read::<Sample, _>(KEYS, "named", payload).unwrap(), want);
        assert_eq!(
            read::<Sample, _>(KEYS, "empty", Value::Null).unwrap(),
            Sample::Empty
        );
    }

    #[test]
    fn an_unknown_tag_or_a_payload_off_its_schema_is_an_error() {
        assert!(read::<Sample, _>(KEYS, "other", json!({})).is_err());
        assert!(read::<Sample, _>(KEYS, "named", json!({"name": 3, "tags": []})).is_err());
        assert!(read::<Sample, _>(KEYS, "named", json!([1])).is_err());
    }
}
