//! The HTTP face of the fake API server: REST routing, list/watch encoding, Status errors.

use super::selector::{FieldSelector, LabelSelector};
use super::store::{merge_patch, Filter, RequestRecord, Resource, StatusError, WatchMsg, WatchReg};
use super::Shared;
use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// What a path addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Object(Resource),
    /// core/v1 Events.
    CoreEvents,
    /// events.k8s.io/v1 Events.
    EventsV1,
}

/// Parse `/api/v1/...` and `/apis/{group}/v1/...` into (target, namespace, name).
fn route(path: &str) -> Option<(Target, Option<String>, Option<String>)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", g, "v1", rest @ ..] => (*g, rest),
        _ => return None,
    };
    let (ns, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(ns.to_string()), *plural, None),
        ["namespaces", ns, plural, name] => (Some(ns.to_string()), *plural, Some(name.to_string())),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(name.to_string())),
        _ => return None,
    };
    let target = match (group, plural) {
        ("", "services") => Target::Object(Resource::Services),
        ("", "nodes") => Target::Object(Resource::Nodes),
        ("", "events") => Target::CoreEvents,
        ("discovery.k8s.io", "endpointslices") => Target::Object(Resource::EndpointSlices),
        ("events.k8s.io", "events") => Target::EventsV1,
        _ => return None,
    };
    if target == Target::Object(Resource::Nodes) && ns.is_some() {
        return None;
    }
    Some((target, ns, name))
}

fn status_response(err: &StatusError) -> Response {
    let code = StatusCode::from_u16(err.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(err.to_status())).into_response()
}

fn json_response(code: StatusCode, v: &impl serde::Serialize) -> Response {
    (code, axum::Json(v)).into_response()
}

/// A list response, serialized straight from its page (a `json!` body would copy every item
/// into a new value first).
#[derive(serde::Serialize)]
struct ListBody<'a> {
    kind: String,
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    metadata: Value,
    items: &'a [Value],
}

fn flag(q: &HashMap<String, String>, k: &str) -> bool {
    matches!(q.get(k).map(String::as_str), Some("1" | "true" | "True"))
}

fn parse_body(headers: &axum::http::HeaderMap, body: &[u8]) -> Result<Value, StatusError> {
    let yaml = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("yaml"));
    if yaml {
        let text = std::str::from_utf8(body)
            .map_err(|e| StatusError::bad_request(format!("body is not UTF-8: {e}")))?;
        serde_saphyr::from_str(text)
            .map_err(|e| StatusError::bad_request(format!("invalid YAML body: {e}")))
    } else {
        serde_json::from_slice(body)
            .map_err(|e| StatusError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// The single handler behind every path.
pub(crate) async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let q: HashMap<String, String> = Query::try_from_uri(req.uri())
        .map(|Query(q)| q)
        .unwrap_or_default();
    let watch = method == Method::GET && flag(&q, "watch");
    let headers = req.headers().clone();
    let body = axum::body::to_bytes(req.into_body(), 64 << 20)
        .await
        .unwrap_or_default();
    let resp = dispatch(&shared, &method, &path, &q, &headers, &body);
    shared.lock().requests.push(RequestRecord {
        method: method.to_string(),
        path,
        query,
        status: resp.status().as_u16(),
        watch,
    });
    resp
}

fn dispatch(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    q: &HashMap<String, String>,
    headers: &axum::http::HeaderMap,
    body: &Bytes,
) -> Response {
    match (method, path) {
        (&Method::GET, "/version") => {
            return json_response(
                StatusCode::OK,
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "linux/amd64"}),
            )
        }
        (&Method::GET, "/healthz" | "/livez" | "/readyz") => return "ok".into_response(),
        (&Method::GET, "/api") => {
            return json_response(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}),
            )
        }
        (&Method::GET, "/apis") => {
            let group = |g: &str| {
                json!({"name": g, "versions": [{"groupVersion": format!("{g}/v1"), "version": "v1"}],
                       "preferredVersion": {"groupVersion": format!("{g}/v1"), "version": "v1"}})
            };
            return json_response(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1",
                        "groups": [group("discovery.k8s.io"), group("events.k8s.io")]}),
            );
        }
        _ => {}
    }
    let Some((target, ns, name)) = route(path) else {
        return status_response(&StatusError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        ));
    };
    let result = match target {
        Target::Object(res) => object_request(shared, res, method, ns, name, q, headers, body),
        Target::CoreEvents | Target::EventsV1 => {
            event_request(shared, method, ns, name, headers, body)
        }
    };
    result.unwrap_or_else(|e| status_response(&e))
}

fn filter_from(q: &HashMap<String, String>, ns: Option<String>) -> Result<Filter, StatusError> {
    Ok(Filter {
        namespace: ns,
        labels: LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str))
            .map_err(|e| StatusError::bad_request(e.to_string()))?,
        fields: FieldSelector::parse(q.get("fieldSelector").map_or("", String::as_str))
            .map_err(|e| StatusError::bad_request(e.to_string()))?,
    })
}

#[allow(clippy::too_many_arguments)]
fn object_request(
    shared: &Arc<Shared>,
    res: Resource,
    method: &Method,
    ns: Option<String>,
    name: Option<String>,
    q: &HashMap<String, String>,
    headers: &axum::http::HeaderMap,
    body: &Bytes,
) -> Result<Response, StatusError> {
    let key_ns = ns.clone().unwrap_or_default();
    match (method, name) {
        (&Method::GET, None) if flag(q, "watch") => watch(shared, res, ns, q),
        (&Method::GET, None) => {
            let filter = filter_from(q, ns)?;
            let limit = match q.get("limit") {
                Some(l) => Some(
                    l.parse::<usize>()
                        .map_err(|_| StatusError::bad_request(format!("invalid limit {l:?}")))?,
                ),
                None => None,
            };
            let exact = q.get("resourceVersionMatch").map(String::as_str) == Some("Exact");
            let page = shared.lock().list(
                res,
                &filter,
                limit,
                q.get("continue").map(String::as_str),
                q.get("resourceVersion").map(String::as_str),
                exact,
            )?;
            let mut meta = json!({"resourceVersion": page.rv.to_string()});
            if let Some(c) = page.continue_token {
                meta["continue"] = json!(c);
            }
            if let Some(r) = page.remaining {
                meta["remainingItemCount"] = json!(r);
            }
            Ok(json_response(
                StatusCode::OK,
                &ListBody {
                    kind: format!("{}List", res.kind()),
                    api_version: res.api_version(),
                    metadata: meta,
                    items: &page.items,
                },
            ))
        }
        (&Method::GET, Some(name)) => {
            let store = shared.lock();
            let obj = store
                .get(&(res, key_ns, name.clone()))
                .ok_or_else(|| StatusError::not_found(res, &name))?;
            Ok(json_response(StatusCode::OK, obj))
        }
        (&Method::POST, None) => {
            let mut obj = parse_body(headers, body)?;
            if let (Some(ns), Some(m)) = (ns, obj.as_object_mut()) {
                let meta = m.entry("metadata").or_insert_with(|| json!({}));
                if let Some(meta) = meta.as_object_mut() {
                    meta.insert("namespace".into(), json!(ns));
                }
            }
            let created = shared.lock().create(res, obj)?;
            Ok(json_response(StatusCode::CREATED, &created))
        }
        (&Method::PUT, Some(name)) => {
            let mut obj = parse_body(headers, body)?;
            let body_name = obj.pointer("/metadata/name").and_then(Value::as_str);
            if body_name.is_some_and(|n| n != name) {
                return Err(StatusError::bad_request(format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    body_name.unwrap_or_default()
                )));
            }
            if let Some(meta) = obj
                .as_object_mut()
                .map(|m| m.entry("metadata").or_insert_with(|| json!({})))
                .and_then(Value::as_object_mut)
            {
                meta.insert("name".into(), json!(name));
                if res.namespaced() {
                    meta.insert("namespace".into(), json!(key_ns));
                }
            }
            let updated = shared.lock().update(res, obj)?;
            Ok(json_response(StatusCode::OK, &updated))
        }
        (&Method::PATCH, Some(name)) => {
            let patch = parse_body(headers, body)?;
            let mut store = shared.lock();
            let mut obj = store
                .get(&(res, key_ns, name.clone()))
                .cloned()
                .ok_or_else(|| StatusError::not_found(res, &name))?;
            merge_patch(&mut obj, &patch);
            if patch.pointer("/metadata/resourceVersion").is_none() {
                if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("resourceVersion");
                }
            }
            let updated = store.update(res, obj)?;
            Ok(json_response(StatusCode::OK, &updated))
        }
        (&Method::DELETE, Some(name)) => {
            let deleted = shared.lock().delete((res, key_ns, name))?;
            Ok(json_response(StatusCode::OK, &deleted))
        }
        _ => Err(StatusError::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported on this path"),
        )),
    }
}

fn watch(
    shared: &Arc<Shared>,
    res: Resource,
    ns: Option<String>,
    q: &HashMap<String, String>,
) -> Result<Response, StatusError> {
    let filter = filter_from(q, ns)?;
    let send_initial = flag(q, "sendInitialEvents");
    let bookmarks = flag(q, "allowWatchBookmarks");
    if send_initial && !bookmarks {
        return Err(StatusError::new(
            422,
            "Invalid",
            "sendInitialEvents: Forbidden: sendInitialEvents requires setting allowWatchBookmarks to true",
        ));
    }
    let timeout = match q.get("timeoutSeconds") {
        Some(t) => Some(
            t.parse::<u64>()
                .map_err(|_| StatusError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
        ),
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    shared.lock().watch(
        WatchReg {
            resource: res,
            namespace: filter.namespace,
            labels: filter.labels,
            fields: filter.fields,
            bookmarks,
            tx,
        },
        q.get("resourceVersion").map(String::as_str),
        send_initial,
    )?;
    let deadline = timeout
        .filter(|t| *t > 0)
        .map(|t| tokio::time::Instant::now() + Duration::from_secs(t));
    let stream = futures::stream::unfold(
        (rx, deadline, false),
        |(mut rx, deadline, done)| async move {
            if done {
                return None;
            }
            let msg = match deadline {
                Some(d) => tokio::select! {
                    m = rx.recv() => m,
                    () = tokio::time::sleep_until(d) => None,
                },
                None => rx.recv().await,
            };
            match msg {
                Some(WatchMsg::Line(b)) => Some((Ok(b), (rx, deadline, false))),
                Some(WatchMsg::Abort) => Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "watch dropped by the fake API server",
                    )),
                    (rx, deadline, true),
                )),
                None => None,
            }
        },
    );
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

fn event_request(
    shared: &Arc<Shared>,
    method: &Method,
    ns: Option<String>,
    name: Option<String>,
    headers: &axum::http::HeaderMap,
    body: &Bytes,
) -> Result<Response, StatusError> {
    let ns = ns.unwrap_or_else(|| "default".into());
    match (method, name) {
        (&Method::POST, None) => {
            let mut ev = parse_body(headers, body)?;
            if let Some(m) = ev.get_mut("metadata").and_then(Value::as_object_mut) {
                m.insert("namespace".into(), json!(ns));
            }
            let stored = shared.lock().record_event(ev)?;
            Ok(json_response(StatusCode::CREATED, &stored))
        }
        (&Method::PATCH | &Method::PUT, Some(name)) => {
            let patch = parse_body(headers, body)?;
            let mut store = shared.lock();
            let mut ev = store.find_event(&ns, &name).ok_or_else(|| {
                StatusError::new(404, "NotFound", format!("events \"{name}\" not found"))
            })?;
            if method == Method::PUT {
                ev = patch;
            } else {
                merge_patch(&mut ev, &patch);
            }
            let stored = store.record_event(ev)?;
            Ok(json_response(StatusCode::OK, &stored))
        }
        (&Method::GET, None) => {
            let store = shared.lock();
            let items: Vec<&Value> = store
                .events
                .iter()
                .filter(|e| e.pointer("/metadata/namespace").and_then(Value::as_str) == Some(&ns))
                .collect();
            Ok(json_response(
                StatusCode::OK,
                &json!({"kind": "EventList", "metadata": {"resourceVersion": store.resource_version().to_string()}, "items": items}),
            ))
        }
        _ => Err(StatusError::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported on events here"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            route("/api/v1/namespaces/x/services/y"),
            Some((
                Target::Object(Resource::Services),
                Some("x".into()),
                Some("y".into())
            ))
        );
        assert_eq!(
            route("/apis/discovery.k8s.io/v1/endpointslices"),
            Some((Target::Object(Resource::EndpointSlices), None, None))
        );
        assert_eq!(
            route("/api/v1/nodes/n1"),
            Some((Target::Object(Resource::Nodes), None, Some("n1".into())))
        );
        assert_eq!(route("/api/v1/namespaces/x/nodes"), None);
        assert_eq!(route("/api/v1/pods"), None);
        assert_eq!(
            route("/apis/events.k8s.io/v1/namespaces/d/events"),
            Some((Target::EventsV1, Some("d".into()), None))
        );
    }
}
