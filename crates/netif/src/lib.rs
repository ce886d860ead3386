//! kube-ipvs0 dummy link and node address tracking over rtnetlink.
