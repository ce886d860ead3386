//! kube-ipvs controller: model, desired state, diff, sync loop.
