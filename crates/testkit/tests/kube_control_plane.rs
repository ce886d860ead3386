//! The real control plane helper itself: etcd + kube-apiserver start, the admin is allowed
//! everything, a ServiceAccount only what RBAC grants it, objects survive an apiserver restart.
//! `kube_*` tests: run by `cargo xtask test`'s kube stage once `cargo xtask kube` has built the
//! upstream binaries (they need no root and no IPVS).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use testkit::control_plane::ControlPlane;

#[test]
#[ignore = "kube"]
fn kube_control_plane_serves_admin_and_service_account() {
    let mut cp = ControlPlane::start().unwrap();
    let version = cp.kubectl(&["version", "-o", "json"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&version).unwrap();
    assert_eq!(
        v["serverVersion"]["gitVersion"],
        format!("v{}", testkit::control_plane::KUBERNETES_VERSION),
        "{version}"
    );
    assert!(cp.kubectl(&["get", "namespace", "kube-system"]).is_ok());

    cp.apply(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: reader, namespace: default}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: reader}\n\
         rules: [{apiGroups: [\"\"], resources: [services], verbs: [list]}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: reader}\n\
         roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reader}\n\
         subjects: [{kind: ServiceAccount, name: reader, namespace: default}]\n",
    )
    .unwrap();
    let kc = cp.service_account_kubeconfig("default", "reader").unwrap();
    let ok = cp.kubectl_as(&kc, &["get", "services", "-A"]).unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let denied = cp.kubectl_as(&kc, &["get", "secrets", "-A"]).unwrap();
    assert!(!denied.status.success());
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    // The audit log names the ServiceAccount's requests.
    let sa = "system:serviceaccount:default:reader";
    let events = cp.audit_events();
    assert!(events
        .iter()
        .any(|e| e["user"]["username"] == sa && e["responseStatus"]["code"] == 403));

    // Objects live in etcd: they survive an apiserver restart, and the token still works.
    cp.kubectl(&["create", "configmap", "keep", "--from-literal=a=b"])
        .unwrap();
    cp.restart_apiserver().unwrap();
    assert!(cp.kubectl(&["get", "configmap", "keep"]).is_ok());
    let ok = cp.kubectl_as(&kc, &["get", "services", "-A"]).unwrap();
    assert!(ok.status.success());
}
