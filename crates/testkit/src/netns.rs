//! Network-namespace helpers: "pods" and test hosts joined by veth.
