//! kube-ipvs: an IPVS-native Kubernetes service proxy.
fn main() {}
