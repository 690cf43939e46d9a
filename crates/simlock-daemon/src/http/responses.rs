//! `simlock_http_responses_total`: the answers the HTTP host gave, by method, route and status.
//! A route is its shape from the routes table (`/v1/leases/{}`), a mount's own name, or
//! `unmatched` for a path no route serves, so the label set stays closed whatever callers send.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{Method, StatusCode};
use parking_lot::Mutex;

use crate::metrics::Metrics;

/// Which route answered, as a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Route {
    /// A route of the host's table, by its shape under `/v1/` (`leases/{}`).
    Table(&'static str),
    /// A mount, by its name (`/v1/agent-device`).
    Mount(&'static str),
    /// A path no route serves.
    Unmatched,
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Table(shape) => write!(f, "/v1/{shape}"),
            Self::Mount(name) => f.write_str(name),
            Self::Unmatched => f.write_str("unmatched"),
        }
    }
}

/// One count's key: method, route, status.
type Key = (&'static str, Route, u16);

/// The answers one HTTP host gave since the daemon started. Those hyper gives itself before a
/// route sees the request (a malformed or oversized head) and a TLS port's answer to plain text
/// are not among them.
#[derive(Clone, Default)]
pub struct HttpResponses {
    counts: Arc<Mutex<BTreeMap<Key, u64>>>,
}

impl std::fmt::Debug for HttpResponses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpResponses")
            .field("series", &self.counts.lock().len())
            .finish()
    }
}

impl HttpResponses {
    /// Answers counted from now on, registered on `metrics` as `simlock_http_responses_total`.
    pub fn new(metrics: &Metrics) -> Self {
        let responses = Self::default();
        responses.register_metrics(metrics);
        responses
    }

    /// Counts one answer.
    pub fn record(&self, method: &Method, route: Route, status: StatusCode) {
        *self
            .counts
            .lock()
            .entry((method_label(method), route, status.as_u16()))
            .or_default() += 1;
    }

    /// Registers `simlock_http_responses_total` on `metrics`.
    fn register_metrics(&self, metrics: &Metrics) {
        let counts = self.counts.clone();
        metrics.counter(
            "simlock_http_responses_total",
            "HTTP answers since the daemon started, by method, route and status.",
            move || {
                counts
                    .lock()
                    .iter()
                    .map(|((method, route, status), n)| {
                        (
                            vec![
                                ("method", (*method).to_owned()),
                                ("route", route.to_string()),
                                ("status", status.to_string()),
                            ],
                            *n as f64,
                        )
                    })
                    .collect()
            },
        );
    }
}

/// A method as a label: the ones HTTP defines, else `other` (an extension method is any token a
/// caller likes).
fn method_label(method: &Method) -> &'static str {
    [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ]
    .iter()
    .find(|known| *known == method)
    .map_or("other", Method::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_counted_by_method_route_and_status() {
        let metrics = Metrics::new();
        let responses = HttpResponses::new(&metrics);
        let lease = Route::Table("leases/{}");
        responses.record(&Method::GET, lease, StatusCode::OK);
        responses.record(&Method::GET, lease, StatusCode::OK);
        responses.record(&Method::GET, lease, StatusCode::NOT_FOUND);
        let odd = Method::from_bytes(b"BREW").unwrap();
        responses.record(&odd, Route::Unmatched, StatusCode::NOT_FOUND);
        let front = Route::Mount("/v1/agent-device");
        responses.record(&Method::POST, front, StatusCode::OK);
        let text = metrics.render();
        for line in [
            "# TYPE simlock_http_responses_total counter\n",
            "simlock_http_responses_total{method=\"GET\",route=\"/v1/leases/{}\",status=\"200\"} 2\n",
            "simlock_http_responses_total{method=\"GET\",route=\"/v1/leases/{}\",status=\"404\"} 1\n",
            "simlock_http_responses_total{method=\"other\",route=\"unmatched\",status=\"404\"} 1\n",
            "simlock_http_responses_total{method=\"POST\",route=\"/v1/agent-device\",status=\"200\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }
}
