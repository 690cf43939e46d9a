//! JSON the way `simctl … -j` prints it: pretty, two-space indent, `"key" : value`, and (on the
//! Xcodes that do) `/` escaped as `\/`.

use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};
use std::io;

/// `PrettyFormatter` with simctl's `" : "` between a key and its value.
struct SimctlFormatter<'a>(PrettyFormatter<'a>);

impl Formatter for SimctlFormatter<'_> {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b" : ")
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.0.end_object_value(w)
    }
}

/// `value` as simctl prints it.
pub fn to_string(value: &impl Serialize, escape_slashes: bool) -> String {
    let mut out = Vec::new();
    let formatter = SimctlFormatter(PrettyFormatter::with_indent(b"  "));
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    value.serialize(&mut ser).expect("JSON of our own values");
    let text = String::from_utf8(out).expect("JSON is UTF-8");
    // In JSON a `/` appears only inside strings, so escaping every one is exact.
    if escape_slashes {
        text.replace('/', "\\/")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn keys_and_values_are_spaced_and_slashes_escaped() {
        let text = super::to_string(&json!({"a": {"dataPath": "/x/y"}, "b": []}), true);
        assert_eq!(
            text,
            "{\n  \"a\" : {\n    \"dataPath\" : \"\\/x\\/y\"\n  },\n  \"b\" : []\n}"
        );
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["a"]["dataPath"], "/x/y");
    }
}
