//! Sources turn the outside world (a static directory, the Kubernetes API) into typed objects.

pub mod static_dir;
