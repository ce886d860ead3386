//! kube-proxy ipsets: desired state, diff and batched apply.
