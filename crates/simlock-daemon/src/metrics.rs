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
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in source() {
                if labels.is_empty() {
                    let _ = writeln!(out, "{name} {value}");
                } else {
                    let labels: Vec<String> = labels
                        .iter()
                        .map(|(k, v)| {
                            format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
                        })
                        .collect();
                    let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
                }
            }
        }
        out
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
}
