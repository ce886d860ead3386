//! The store: events in, dirty services and node changes out; relist semantics; sync gating.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers

mod fixtures;

use std::collections::BTreeSet;

use fixtures::*;
use model::event::{Kind, Object, SourceEvent};
use model::store::Store;
use model::ServiceName;

fn svc_obj(name: &str, ip: &str) -> Object {
    Object::from(svc("ns", name, ip).port("http", 80, "TCP").build())
}

fn slice_obj(svc_name: &str, slice_name: &str, ep: &str) -> Object {
    Object::from(
        slice("ns", svc_name, slice_name)
            .port("http", 8080, "TCP")
            .ep(ep, "node-b", C::Ready)
            .build(),
    )
}

fn names(v: &[&str]) -> BTreeSet<ServiceName> {
    v.iter().map(|n| ServiceName::new("ns", *n)).collect()
}

#[test]
fn model_store_initial_sync_and_dirty_sets() {
    let mut s = Store::new();
    assert!(!s.synced());
    s.apply(SourceEvent::Init(Kind::Service));
    let ch = s.apply(SourceEvent::InitApply(svc_obj("a", "10.96.0.1")));
    assert_eq!(ch.dirty, names(&["a"]));
    s.apply(SourceEvent::InitDone(Kind::Service));
    assert!(!s.synced(), "slices not listed yet");
    s.apply(SourceEvent::Init(Kind::EndpointSlice));
    let ch = s.apply(SourceEvent::InitApply(slice_obj("a", "a-1", "10.244.0.1")));
    assert_eq!(ch.dirty, names(&["a"]));
    s.apply(SourceEvent::InitDone(Kind::EndpointSlice));
    assert!(s.synced());
    assert_eq!(s.slices_of(&ServiceName::new("ns", "a")).len(), 1);

    // Unchanged re-announcement: nothing dirty.
    assert!(s
        .apply(SourceEvent::Apply(svc_obj("a", "10.96.0.1")))
        .is_empty());
    assert!(s
        .apply(SourceEvent::Apply(slice_obj("a", "a-1", "10.244.0.1")))
        .is_empty());
    // A changed slice dirties its service only.
    s.apply(SourceEvent::Apply(svc_obj("b", "10.96.0.2")));
    let ch = s.apply(SourceEvent::Apply(slice_obj("a", "a-1", "10.244.0.9")));
    assert_eq!(ch.dirty, names(&["a"]));
    // A second slice of the same service is merged.
    s.apply(SourceEvent::Apply(slice_obj("a", "a-2", "10.244.0.2")));
    assert_eq!(s.slices_of(&ServiceName::new("ns", "a")).len(), 2);
    // A slice moving to another service dirties both.
    let ch = s.apply(SourceEvent::Apply(slice_obj("b", "a-2", "10.244.0.2")));
    assert_eq!(ch.dirty, names(&["a", "b"]));
    assert_eq!(s.slices_of(&ServiceName::new("ns", "a")).len(), 1);
    assert_eq!(s.slices_of(&ServiceName::new("ns", "b")).len(), 1);
    // Deletes.
    let ch = s.apply(SourceEvent::Delete(slice_obj("b", "a-2", "10.244.0.2")));
    assert_eq!(ch.dirty, names(&["b"]));
    let ch = s.apply(SourceEvent::Delete(svc_obj("b", "10.96.0.2")));
    assert_eq!(ch.dirty, names(&["b"]));
    assert!(s.service(&ServiceName::new("ns", "b")).is_none());
    // Deleting something unknown changes nothing.
    assert!(s
        .apply(SourceEvent::Delete(svc_obj("zz", "10.96.0.3")))
        .is_empty());
}

#[test]
fn model_store_relist_deletes_unannounced() {
    let mut s = Store::new();
    for ev in [
        SourceEvent::Init(Kind::Service),
        SourceEvent::InitApply(svc_obj("a", "10.96.0.1")),
        SourceEvent::InitApply(svc_obj("b", "10.96.0.2")),
        SourceEvent::InitApply(svc_obj("c", "10.96.0.3")),
        SourceEvent::InitDone(Kind::Service),
        SourceEvent::Init(Kind::EndpointSlice),
        SourceEvent::InitApply(slice_obj("a", "a-1", "10.244.0.1")),
        SourceEvent::InitApply(slice_obj("b", "b-1", "10.244.0.2")),
        SourceEvent::InitDone(Kind::EndpointSlice),
    ] {
        s.apply(ev);
    }
    // Relist after a 410: b is gone, c changed, a unchanged.
    let mut dirty = BTreeSet::new();
    for ev in [
        SourceEvent::Init(Kind::Service),
        SourceEvent::InitApply(svc_obj("a", "10.96.0.1")),
        SourceEvent::InitApply(svc_obj("c", "10.96.0.33")),
        SourceEvent::InitDone(Kind::Service),
        SourceEvent::Init(Kind::EndpointSlice),
        SourceEvent::InitApply(slice_obj("a", "a-1", "10.244.0.1")),
        SourceEvent::InitDone(Kind::EndpointSlice),
    ] {
        dirty.extend(s.apply(ev).dirty);
    }
    assert_eq!(dirty, names(&["b", "c"]));
    assert_eq!(s.service_count(), 2);
    assert_eq!(s.slice_count(), 1);
    assert!(s.slices_of(&ServiceName::new("ns", "b")).is_empty());
}

#[test]
fn model_store_node_changes() {
    let mut s = Store::new();
    let n1 = Object::Node(Box::new(node_obj(NODE, "zone-a", "192.168.0.10")));
    assert!(s.apply(SourceEvent::Apply(n1.clone())).node_changed);
    assert!(!s.apply(SourceEvent::Apply(n1)).node_changed);
    // Another label or field that the model ignores: no change.
    let mut other = node_obj(NODE, "zone-a", "192.168.0.10");
    other
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("foo".into(), "bar".into());
    assert!(
        !s.apply(SourceEvent::Apply(Object::Node(Box::new(other))))
            .node_changed
    );
    let zone = Object::Node(Box::new(node_obj(NODE, "zone-b", "192.168.0.10")));
    assert!(s.apply(SourceEvent::Apply(zone)).node_changed);
    let addr = Object::Node(Box::new(node_obj(NODE, "zone-b", "192.168.0.11")));
    let ch = s.apply(SourceEvent::Apply(addr.clone()));
    assert!(ch.node_changed && ch.dirty.is_empty());
    assert!(s.apply(SourceEvent::Delete(addr)).node_changed);
    assert!(s.node().is_none());
}

/// The store keeps compact objects: an update that only touches what the proxy never reads
/// (resource version, managed fields, labels, unrelated annotations, target references)
/// dirties nothing, while a field the model reads still does.
#[test]
fn model_store_ignores_changes_to_fields_the_proxy_does_not_read() {
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
    let mut s = Store::new();
    s.apply(SourceEvent::Apply(svc_obj("a", "10.96.0.1")));
    s.apply(SourceEvent::Apply(slice_obj("a", "a-1", "10.244.0.1")));

    let mut svc = svc("ns", "a", "10.96.0.1").port("http", 80, "TCP").build();
    svc.metadata.resource_version = Some("42".into());
    svc.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default(); 3]);
    svc.metadata.labels = Some([("app".to_string(), "x".to_string())].into());
    svc.metadata.annotations = Some(
        [(
            "kubectl.kubernetes.io/last-applied-configuration".to_string(),
            "{}".repeat(500),
        )]
        .into(),
    );
    svc.spec.as_mut().unwrap().selector = Some([("app".to_string(), "x".to_string())].into());
    assert!(s
        .apply(SourceEvent::Apply(Object::from(svc.clone())))
        .is_empty());

    let mut sl = slice("ns", "a", "a-1")
        .port("http", 8080, "TCP")
        .ep("10.244.0.1", "node-b", C::Ready)
        .build();
    sl.metadata.resource_version = Some("43".into());
    sl.endpoints[0].target_ref = Some(ObjectReference {
        kind: Some("Pod".into()),
        name: Some("pod-1".into()),
        ..Default::default()
    });
    sl.endpoints[0].hostname = Some("pod-1".into());
    assert!(s
        .apply(SourceEvent::Apply(Object::from(sl.clone())))
        .is_empty());

    // What the model reads still counts.
    svc.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
    assert_eq!(
        s.apply(SourceEvent::Apply(Object::from(svc))).services,
        names(&["a"])
    );
    sl.endpoints[0].conditions.as_mut().unwrap().ready = Some(false);
    assert_eq!(
        s.apply(SourceEvent::Apply(Object::from(sl))).endpoints,
        names(&["a"])
    );
}

/// Node names are interned and the interner is bounded by what is in use: endpoints moving
/// across ever new node names do not grow it without bound.
#[test]
fn model_store_node_name_interning_is_bounded() {
    let mut s = Store::new();
    s.apply(SourceEvent::Apply(svc_obj("a", "10.96.0.1")));
    for round in 0..20_000 {
        let node = format!("node-{round}");
        s.apply(SourceEvent::Apply(Object::from(
            slice("ns", "a", "a-1")
                .port("http", 8080, "TCP")
                .ep("10.244.0.1", &node, C::Ready)
                .build(),
        )));
    }
    let n = s.interned_names();
    assert!(n <= 1024, "{n} names interned for 1 in use");
    let p = s.interned_placements();
    assert!(p <= 1024, "{p} placements interned for 1 in use");
    let slices = s.slices_of(&ServiceName::new("ns", "a"));
    assert_eq!(
        slices[0].endpoints[0].node_name().map(|n| &**n),
        Some("node-19999")
    );
}

/// Namespaces, types, port names and protocols are interned too: Services and slices in one
/// namespace share one copy of each such string, and the store's keys share the objects'
/// names (the namespace a slice names its Service in as well).
#[test]
fn model_store_shares_namespaces_and_vocabulary_strings() {
    use std::sync::Arc;
    let mut s = Store::new();
    for (name, ip) in [("a", "10.96.0.1"), ("b", "10.96.0.2")] {
        s.apply(SourceEvent::Apply(svc_obj(name, ip)));
        s.apply(SourceEvent::Apply(slice_obj(
            name,
            &format!("{name}-1"),
            "10.244.0.1",
        )));
    }
    let (a, b) = (ServiceName::new("ns", "a"), ServiceName::new("ns", "b"));
    let (sa, sb) = (s.service(&a).unwrap(), s.service(&b).unwrap());
    assert!(Arc::ptr_eq(&sa.name.namespace, &sb.name.namespace));
    let (spa, spb) = (sa.spec.as_deref().unwrap(), sb.spec.as_deref().unwrap());
    let shared = |x: &Option<Arc<str>>, y: &Option<Arc<str>>| match (x, y) {
        (Some(x), Some(y)) => Arc::ptr_eq(x, y),
        _ => false,
    };
    assert!(shared(&spa.type_, &spb.type_));
    let (pa, pb) = (
        &spa.ports.as_ref().unwrap()[0],
        &spb.ports.as_ref().unwrap()[0],
    );
    assert!(shared(&pa.name, &pb.name) && shared(&pa.protocol, &pb.protocol));
    let (la, lb) = (s.slices_of(&a)[0], s.slices_of(&b)[0]);
    assert!(Arc::ptr_eq(&la.namespace, &sa.name.namespace));
    assert!(Arc::ptr_eq(&la.namespace, &lb.namespace));
    let owner = la.service.as_ref().unwrap();
    assert!(Arc::ptr_eq(&owner.namespace, &sa.name.namespace));
    assert!(Arc::ptr_eq(&la.ports[0].name, &lb.ports[0].name));
    assert!(shared(&la.ports[0].protocol, &pa.protocol));
    // Endpoints on one node share one placement (node name and hints).
    let placement = |l: &model::objects::Slice| l.endpoints[0].placement.clone().unwrap();
    assert!(Arc::ptr_eq(&placement(la), &placement(lb)));
    // Still the objects' own values.
    assert_eq!(
        (&*la.ports[0].name, pa.protocol.as_deref()),
        ("http", Some("TCP"))
    );
}
