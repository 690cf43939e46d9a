//! `/v1/metrics`: gauges and counters components register as closures, rendered in the
//! Prometheus text format.

use std::fmt::Write as _;
use std::sync::Arc;

use parking_lot::Mutex;

/// One sample: label pairs and a value.
pub type Sample = (Vec<(&'static str, String)>, f64);

type Source = Arc<dyn Fn() -> Vec<Sample> + Send + Sync>;

struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    source: Source,
}

/// The metrics of one daemon.
#[derive(Clone, Default)]
pub struct Metrics {
    families: Arc<Mutex<Vec<Family>>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("families", &self.families.lock().len())
            .finish()
    }
}

impl Metrics {
    /// No metrics yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A gauge read from `source` at each scrape.
    pub fn gauge(
        &self,
        name: &'static str,
        help: &'static str,
        source: impl Fn() -> Vec<Sample> + Send + Sync + 'static,
    ) {
        self.add(name, help, "gauge", source);
    }

    /// A counter read from `source` at each scrape.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        source: impl Fn() -> Vec<Sample> + Send + Sync + 'static,
    ) {
        self.add(name, help, "counter", source);
    }

    fn add(
        &self,
        name: &'static str,
        help: &'static str,
        kind: &'static str,
        source: impl Fn() -> Vec<Sample> + Send + Sync + 'static,
    ) {
        self.families.lock().push(Family {
            name,
            help,
            kind,
            source: Arc::new(source),
        });
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let families: Vec<(&'static str, &'static str, &'static str, Source)> = self
            .families
            .lock()
            .iter()
            .map(|f| (f.name, f.help, f.kind, f.source.clone()))
            .collect();
        let mut out = String::new();
        for (name, help, kind, source) in families {
            let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in source() {
                let value = sample_value(value);
                if labels.is_empty() {
                    let _ = writeln!(out, "{name} {value}");
                } else {
                    let labels: Vec<String> = labels
                        .iter()
                        .map(|(k, v)| format!("{k}=\"{}\"", escape_label_value(v)))
                        .collect();
                    let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
                }
            }
        }
        out
    }
}

/// A label value in the text format: `\`, `"` and a line feed escaped (labels such as a
/// worker's are user text).
fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            other => out.push(other),
        }
    }
    out
}

/// A `# HELP` text: `\` and a line feed escaped.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value as the text format spells it (`NaN`, `+Inf`, `-Inf`, or the number).
fn sample_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_text_format() {
        let metrics = Metrics::new();
        metrics.gauge("simlock_leases", "Active leases.", || vec![(vec![], 2.0)]);
        metrics.counter("simlock_bytes_total", "Bytes.", || {
            vec![(vec![("worker", "w\"1".into())], 5.0)]
        });
        let expected = r#"# HELP simlock_leases Active leases.
# TYPE simlock_leases gauge
simlock_leases 2
# HELP simlock_bytes_total Bytes.
# TYPE simlock_bytes_total counter
simlock_bytes_total{worker="w\"1"} 5
"#;
        assert_eq!(metrics.render(), expected);
    }

    #[test]
    fn label_values_escape_backslash_quote_and_line_feed() {
        let metrics = Metrics::new();
        metrics.gauge("simlock_up", "Up,\nwith a \\ in its help.", || {
            vec![(
                vec![("worker", "a\\b\"c\nd\re é".into()), ("n", String::new())],
                1.0,
            )]
        });
        let expected = [
            r"# HELP simlock_up Up,\nwith a \\ in its help.",
            "# TYPE simlock_up gauge",
            "simlock_up{worker=\"a\\\\b\\\"c\\nd\re é\",n=\"\"} 1",
            "",
        ]
        .join("\n");
        assert_eq!(metrics.render(), expected);
    }

    #[test]
    fn special_values_are_spelled_as_the_text_format_does() {
        let metrics = Metrics::new();
        metrics.gauge("simlock_x", "X.", || {
            vec![
                (vec![("v", "nan".into())], f64::NAN),
                (vec![("v", "inf".into())], f64::INFINITY),
                (vec![("v", "-inf".into())], f64::NEG_INFINITY),
                (vec![("v", "half".into())], 0.5),
                (vec![("v", "big".into())], 1e21),
            ]
        });
        let rendered = metrics.render();
        let values: Vec<&str> = rendered
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.rsplit(' ').next().unwrap_or_default())
            .collect();
        assert_eq!(
            values,
            ["NaN", "+Inf", "-Inf", "0.5", "1000000000000000000000"]
        );
    }
}
