//! The inspection and control API under `/__fake/`: unauthenticated JSON routes that let a test
//! read and steer a fake it spawned as a process (the crate docs list every route). These
//! requests are not recorded.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::model::{CommandFailure, DevicesAnswer, LeaseOp};
use crate::server::{Body, Shared, VERSION};
use crate::wire::DaemonError;

/// The largest control request body (a screenshot's bytes fit).
const CONTROL_BODY_CAP: usize = 16 * 1024 * 1024;

fn respond(status: StatusCode, body: &Value) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn ok(body: &Value) -> Response<Body> {
    respond(StatusCode::OK, body)
}

fn problem(status: StatusCode, message: &str) -> Response<Body> {
    respond(status, &json!({ "error": message }))
}

async fn body_bytes(body: Incoming) -> Result<Bytes, Response<Body>> {
    Limited::new(body, CONTROL_BODY_CAP)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .map_err(|_| {
            problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "control body too large or cut off",
            )
        })
}

async fn body_json<T: DeserializeOwned>(body: Incoming) -> Result<T, Response<Body>> {
    let bytes = body_bytes(body).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| problem(StatusCode::BAD_REQUEST, &format!("bad control body: {e}")))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LeaseFailures {
    op: LeaseOp,
    count: u32,
    error: DaemonError,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewHold {
    command: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Delay {
    ms: Option<u64>,
}

pub(crate) async fn handle(shared: &Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let rest = path.strip_prefix("/__fake/").unwrap_or_default();
    let segments: Vec<&str> = rest.split('/').collect();
    let body = request.into_body();
    let outcome = match (&method, segments.as_slice()) {
        (&Method::GET, ["info"]) => Ok(ok(&json!({
            "version": VERSION,
            "port": shared.local.port(),
            "token": shared.token,
            "stateDir": shared.state_dir,
            "pid": std::process::id(),
            "now": shared.clock.now_ms(),
        }))),
        (&Method::GET, ["requests"]) => {
            let records: Vec<Value> = shared
                .log
                .lock()
                .snapshot()
                .iter()
                .map(crate::record::RecordedRequest::to_control_json)
                .collect();
            Ok(ok(&Value::Array(records)))
        }
        (&Method::DELETE, ["requests"]) => {
            shared.log.lock().clear();
            Ok(ok(&json!({ "ok": true })))
        }
        (&Method::GET, ["leases"]) => {
            let now = shared.clock.now_ms();
            let leases = shared.model.lock().active_leases(now);
            Ok(ok(&json!(leases)))
        }
        (&Method::GET, ["uploads"]) => Ok(ok(&json!(shared.model.lock().finalized_uploads()))),
        (&Method::GET, ["sessions"]) => Ok(ok(&json!(shared.model.lock().sessions()))),
        (&Method::PUT, ["devices"]) => match body_json::<DevicesAnswer>(body).await {
            Ok(answer) => {
                shared.model.lock().set_devices(answer);
                Ok(ok(&json!({ "ok": true })))
            }
            Err(response) => Err(response),
        },
        (&Method::POST, ["lease-failures"]) => match body_json::<LeaseFailures>(body).await {
            Ok(failures) => {
                let mut model = shared.model.lock();
                if failures.count == 0 {
                    model.knobs.lease_failures.remove(&failures.op);
                } else {
                    model
                        .knobs
                        .lease_failures
                        .insert(failures.op, (failures.count, failures.error));
                }
                Ok(ok(&json!({ "ok": true })))
            }
            Err(response) => Err(response),
        },
        (&Method::POST, ["command-failures"]) => match body_json::<CommandFailure>(body).await {
            Ok(rule) => {
                shared.model.lock().knobs.command_failures.push(rule);
                Ok(ok(&json!({ "ok": true })))
            }
            Err(response) => Err(response),
        },
        (&Method::DELETE, ["command-failures"]) => {
            shared.model.lock().knobs.command_failures.clear();
            Ok(ok(&json!({ "ok": true })))
        }
        (&Method::GET, ["holds"]) => Ok(ok(&json!(shared.holds.list()))),
        (&Method::POST, ["holds"]) => match body_json::<NewHold>(body).await {
            Ok(hold) => Ok(ok(&json!({ "id": shared.holds.add(&hold.command) }))),
            Err(response) => Err(response),
        },
        (&Method::GET, ["holds", id]) => Ok(
            match id.parse().ok().and_then(|id| shared.holds.status(id)) {
                Some(status) => ok(&json!(status)),
                None => problem(StatusCode::NOT_FOUND, "no such hold"),
            },
        ),
        (&Method::DELETE, ["holds", id]) => Ok(
            match id.parse().ok().filter(|id| shared.holds.release(*id)) {
                Some(_) => ok(&json!({ "ok": true })),
                None => problem(StatusCode::NOT_FOUND, "no such hold"),
            },
        ),
        (&Method::PUT, ["rpc-delay"]) => match body_json::<Delay>(body).await {
            Ok(delay) => {
                shared.model.lock().knobs.rpc_delay = delay.ms.map(Duration::from_millis);
                Ok(ok(&json!({ "ok": true })))
            }
            Err(response) => Err(response),
        },
        (&Method::PUT, ["screenshot"]) => match body_bytes(body).await {
            Ok(bytes) => {
                shared.model.lock().knobs.screenshot = bytes;
                Ok(ok(&json!({ "ok": true })))
            }
            Err(response) => Err(response),
        },
        _ => Err(problem(StatusCode::NOT_FOUND, "no such control route")),
    };
    outcome.unwrap_or_else(|response| response)
}
