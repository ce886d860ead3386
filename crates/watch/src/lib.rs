//! kube-ipvs sources: where a Service's journey starts. The Kubernetes watchers ([`kube`]) and
//! the static directory ([`static_dir`]) turn API objects into the compact objects of crate
//! `model` as they arrive and emit the same `SourceEvent` stream (`model::event`).
//!
//! The crate is named after what it does (watch a cluster or a directory); within it, tokio's
//! `watch` channel is always written `tokio::sync::watch`.

pub mod kube;
pub mod lenient;
pub mod static_dir;
