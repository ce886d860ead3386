//! kube-proxy iptables rules: render, diff and iptables-restore.
