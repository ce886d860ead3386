//! Timeouts of the Kubernetes side against an API server that accepts connections and never
//! answers (a hung apiserver, or a load balancer in front of a dead one): a request fails with
//! the client's read timeout, and publishing an Event gives up after its limit, instead of
//! either hanging for good.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Read;
use std::net::TcpListener;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube_ipvs::cli;
use kube_ipvs::config::{self, KubeClientConfig};
use kube_ipvs::daemon::{kube_client, KUBE_CONNECT_TIMEOUT, KUBE_READ_TIMEOUT, KUBE_WRITE_TIMEOUT};
use kube_ipvs::events::{publish_bounded, PublishError, EVENT_PUBLISH_TIMEOUT};

/// Guard against a regression hanging the test run: far above every limit the tests set.
const GUARD: Duration = Duration::from_secs(120);

/// An API server that accepts every connection and reads requests but never writes a byte.
fn silent_api_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
            });
        }
    });
    format!("http://{addr}")
}

/// The client settings the daemon derives from `--master URL` (the defaults otherwise).
fn client_settings(master: &str) -> KubeClientConfig {
    let args = cli::parse(["kube-ipvs", "--master", master]).unwrap();
    config::from_sources(None, &args.flags, || Ok("node-a".into()))
        .unwrap()
        .config
        .kube
}

#[test]
fn client_timeouts_default_to_the_documented_values() {
    let c = client_settings("http://127.0.0.1:1");
    assert_eq!(c.connect_timeout, KUBE_CONNECT_TIMEOUT);
    assert_eq!(c.write_timeout, KUBE_WRITE_TIMEOUT);
    assert_eq!(c.read_timeout, KUBE_READ_TIMEOUT);
    // A quiet watch lasts up to the server-side timeout (290 s) and kube-runtime's idle
    // timeout fires 5 s after it: the read timeout must not cut a healthy watch first.
    assert!(KUBE_READ_TIMEOUT > Duration::from_secs(295));
}

#[tokio::test]
async fn request_to_a_silent_api_server_fails_after_the_read_timeout() {
    let mut settings = client_settings(&silent_api_server());
    settings.read_timeout = Duration::from_millis(500);
    let client = kube_client(&settings).await.unwrap();
    let nodes: kube::Api<Node> = kube::Api::all(client);
    let outcome = tokio::time::timeout(GUARD, nodes.list(&Default::default())).await;
    let err = match outcome {
        Ok(Err(e)) => e,
        Ok(Ok(list)) => panic!("a silent server answered: {list:?}"),
        Err(_) => panic!("the request hung past {GUARD:?}: no read timeout"),
    };
    // The cause is the client's read timeout (an io::Error of kind TimedOut in the chain).
    let mut cause: Option<&dyn std::error::Error> = Some(&err);
    let mut timed_out = false;
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            timed_out |= io.kind() == std::io::ErrorKind::TimedOut;
        }
        cause = e.source();
    }
    assert!(timed_out, "not a read timeout: {err:?}");
}

#[tokio::test]
async fn event_publishing_to_a_silent_api_server_gives_up_after_its_limit() {
    let settings = client_settings(&silent_api_server());
    // The real read timeout (300 s) is far longer than the publishing limit: the limit is what
    // ends the call.
    let client = kube_client(&settings).await.unwrap();
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "kube-ipvs".into(),
            instance: Some("node-a".into()),
        },
    );
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some("node-a".into()),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: "Test".into(),
        note: Some("test".into()),
        action: "Test".into(),
        secondary: None,
    };
    let limit = Duration::from_millis(300);
    let outcome =
        tokio::time::timeout(GUARD, publish_bounded(&recorder, &ev, &reference, limit)).await;
    match outcome {
        Ok(Err(PublishError::Timeout(l))) => assert_eq!(l, limit),
        Ok(other) => panic!("expected a publishing timeout, got {other:?}"),
        Err(_) => panic!("publishing hung past {GUARD:?}"),
    }
    assert!(EVENT_PUBLISH_TIMEOUT < KUBE_READ_TIMEOUT);
}
