//! Publishing Kubernetes Events with a time limit, so an API server that does not answer holds
//! up neither the Events after it nor the proxy's start.

/// Longest time publishing one Event may take (the API call, its retries included) before it
/// is given up and logged: an API server that does not answer must not hold up the Events
/// after it, nor (for the Node Event) the start of the proxy.
pub const EVENT_PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why an Event was not published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The API server refused it or could not be reached.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// No answer within [`EVENT_PUBLISH_TIMEOUT`].
    #[error("no answer from the API server within {0:?}")]
    Timeout(std::time::Duration),
}

/// Publishes `ev` regarding `reference`, for at most `limit`.
pub async fn publish_bounded(
    recorder: &kube::runtime::events::Recorder,
    ev: &kube::runtime::events::Event,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    limit: std::time::Duration,
) -> Result<(), PublishError> {
    match tokio::time::timeout(limit, recorder.publish(ev, reference)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PublishError::Timeout(limit)),
    }
}

/// Publishes one Warning Event regarding this node's Node object (e.g. the IPVS fallback).
pub async fn publish_node_event(
    client: kube::Client,
    node_name: String,
    reason: &'static str,
    action: &'static str,
    note: String,
) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "kube-ipvs".into(),
            instance: Some(node_name.clone()),
        },
    );
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node_name),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(crate::events::sanitize(
            &note,
            crate::events::NOTE_MAX_BYTES,
        )),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = publish_bounded(&recorder, &ev, &reference, EVENT_PUBLISH_TIMEOUT).await {
        tracing::warn!(error = %e, reason, "could not emit an Event on the Node");
    }
}
