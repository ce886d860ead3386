//! Services decoded one by one, so one the proxy cannot decode never stops the watch.
//!
//! kube-runtime decodes a list page or a watch event as a whole: one Service that does not fit
//! k8s-openapi's types fails the list, and every relist fails the same way, so every node's
//! proxy would serve a frozen view of every Service until that one object changes. The API
//! server stores such objects: `status.conditions[]` with `lastTransitionTime: null` (what a
//! Go client writes for a zero time; `Services should complete a service status lifecycle`
//! does exactly this) is refused by k8s-openapi's required `Condition.lastTransitionTime`.
//!
//! [`WatchedService`] decodes each Service on its own: first as it is; else without
//! `status.conditions` (which no proxy reads); else it is [`Undecodable`]: its metadata and, when
//! it decodes, its spec are kept with the error, and the model rejects it as invalid (so its
//! last good state, or after a restart what the kernel holds for it, is kept: the path every
//! invalid Service takes). Upstream's informers decode into Go structs that accept a null time.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use serde::{Deserialize, Deserializer};

/// The longest decode error kept (a serde error quotes input).
const MAX_ERROR: usize = 256;

/// A Service the proxy could not decode: what could be read of it, and why not the rest.
#[derive(Debug, Clone, Default)]
pub struct Undecodable {
    /// Its metadata (default when even that does not decode).
    pub meta: ObjectMeta,
    /// Its spec, when that decodes on its own.
    pub spec: Option<ServiceSpec>,
    /// The decode error, at most [`MAX_ERROR`] bytes.
    pub error: String,
}

/// A Service from the watch: decoded, or [`Undecodable`].
#[derive(Debug, Clone)]
pub struct WatchedService(pub Result<Service, Box<Undecodable>>);

impl<'de> Deserialize<'de> for WatchedService {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Only input that is not JSON at all fails here (and fails the page, as it must).
        let mut v = serde_json::Value::deserialize(d)?;
        Ok(WatchedService(decode(&mut v)))
    }
}

fn decode(v: &mut serde_json::Value) -> Result<Service, Box<Undecodable>> {
    let mut error = match serde_path_to_error::deserialize::<_, Service>(&*v) {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    let conditions = v
        .get_mut("status")
        .and_then(|s| s.as_object_mut())
        .and_then(|s| s.remove("conditions"));
    if conditions.is_some() {
        match serde_path_to_error::deserialize::<_, Service>(&*v) {
            Ok(s) => return Ok(s),
            Err(e) => error = e,
        }
    }
    let part = |k: &str| v.get(k).filter(|x| !x.is_null());
    let meta = part("metadata")
        .and_then(|m| ObjectMeta::deserialize(m).ok())
        .unwrap_or_default();
    let spec = part("spec").and_then(|s| ServiceSpec::deserialize(s).ok());
    Err(Box::new(Undecodable {
        meta,
        spec,
        error: cut(error.to_string()),
    }))
}

fn cut(mut s: String) -> String {
    if s.len() > MAX_ERROR {
        let mut end = MAX_ERROR;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

impl kube::Resource for WatchedService {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        <Service as kube::Resource>::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        <Service as kube::Resource>::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        <Service as kube::Resource>::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        <Service as kube::Resource>::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        match &self.0 {
            Ok(s) => &s.metadata,
            Err(u) => &u.meta,
        }
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match &mut self.0 {
            Ok(s) => &mut s.metadata,
            Err(u) => &mut u.meta,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `Services should complete a service status lifecycle` stores: a condition whose
    /// `lastTransitionTime` is null.
    fn with_null_time() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default", "resourceVersion": "7"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
            "status": {
                "loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]},
                "conditions": [{"type": "StatusUpdate", "status": "True",
                    "lastTransitionTime": null, "reason": "E2E", "message": "Set from e2e test"}]
            }
        })
    }

    #[test]
    fn k8s_openapi_refuses_a_null_condition_time() {
        let e = serde_json::from_value::<Service>(with_null_time()).unwrap_err();
        assert!(e.to_string().contains("null"), "{e}");
    }

    #[test]
    fn a_service_with_a_null_condition_time_decodes_without_its_conditions() {
        let w: WatchedService = serde_json::from_value(with_null_time()).unwrap();
        let s = w.0.unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("web"));
        let st = s.status.unwrap();
        assert!(st.conditions.is_none());
        let ingress = st.load_balancer.unwrap().ingress.unwrap();
        assert_eq!(ingress[0].ip.as_deref(), Some("203.0.113.1"));
    }

    #[test]
    fn an_undecodable_service_keeps_its_name_and_spec_and_fails_nothing_else() {
        let mut bad = with_null_time();
        bad["status"]["loadBalancer"] = serde_json::json!({"ingress": "not a list"});
        let good = serde_json::json!({
            "metadata": {"name": "ok", "namespace": "default"},
            "spec": {"clusterIP": "10.96.0.11"}
        });
        let list = serde_json::json!({"items": [good, bad]});
        #[derive(Deserialize)]
        struct Page {
            items: Vec<WatchedService>,
        }
        let page: Page = serde_json::from_str(&list.to_string()).unwrap();
        assert_eq!(page.items.len(), 2);
        assert_eq!(
            page.items[0].0.as_ref().unwrap().metadata.name.as_deref(),
            Some("ok")
        );
        let u = page.items[1].0.as_ref().unwrap_err();
        assert_eq!(u.meta.name.as_deref(), Some("web"));
        assert_eq!(
            u.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("10.96.0.10")
        );
        assert!(
            u.error
                .starts_with("status.loadBalancer.ingress: invalid type"),
            "{}",
            u.error
        );
        assert!(u.error.len() <= MAX_ERROR + '…'.len_utf8());
    }
}
